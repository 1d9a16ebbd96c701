"""FLUX.1 text-to-image pipeline: CLIP + T5 prompt encoding, our MMDiT, flow-matching Euler, AutoencoderKL decode.

Numerically the same recipe as diffusers' `FluxPipeline` (same noise for the same seed, same sigmas and shift,
same guidance embedding, diffusers' FlowMatchEulerDiscreteScheduler), so images match it. It runs on the
`NativeDiffusionPipeline` template: requests that share sampling params run as one batch; when true CFG is on,
positive rows and the negatives of the requests that have one go through the transformer as one forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm_omni.diffusion.cache.policy import FamilyPresets
from vllm_omni.diffusion.distributed.parallel_state import shared_random_seed
from vllm_omni.diffusion.model_loader.components import load_native_transformer
from vllm_omni.diffusion.model_loader.dummy import load_pretrained
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.logger import init_logger
from vllm_omni.models.flux.cache import PRESETS
from vllm_omni.models.flux.transformer import FluxTransformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

logger = init_logger(__name__)

DEFAULT_STEPS = 28
DEFAULT_GUIDANCE = 3.5
DEFAULT_MAX_SEQUENCE_LENGTH = 512


def calculate_shift(seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float) -> float:
    """Resolution-dependent timestep shift `mu` (linear in the number of image tokens)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return seq_len * slope + base_shift - slope * base_seq_len


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 latent patches as tokens."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_latents` for a latent grid of h x w."""
    b, _, c4 = latents.shape
    return latents.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, h, w)


def latent_image_ids(h2: int, w2: int) -> torch.Tensor:
    """(h2*w2, 3) positions (0, row, col) of the packed image tokens."""
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = torch.arange(h2)[:, None]
    ids[..., 2] = torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3)


@dataclass
class FluxConditioning(Conditioning):
    """What the transformer rows of one group are conditioned on besides latents and timestep.

    Rows: one per latent row, then one per latent row in `cfg.uncond` (the negative prompt of a true-CFG
    request's row).
    """

    embeds: torch.Tensor
    pooled: torch.Tensor
    cfg: CFG | None
    """True CFG over the latent rows whose request has a negative prompt; None: no request has one."""
    lh: int
    lw: int
    """Latent grid (height, width) before packing."""
    guidance: torch.Tensor | None = None
    rotary_emb: Any = None
    step_timesteps: torch.Tensor | None = None
    """(steps, rows): each step's timestep per transformer row, as the step passes it."""
    modulation: Any = None
    """Every step's adaLN parameters, per transformer row (`FluxTransformer2DModel.step_modulation`)."""

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> FluxConditioning:
        """Keeps latent rows `rows` and their negatives; the rotary embedding is shared by all rows."""
        double, single, final = self.modulation
        return replace(self, embeds=self.embeds.index_select(0, text_rows),
                       pooled=self.pooled.index_select(0, text_rows),
                       guidance=None if self.guidance is None else self.guidance.index_select(0, text_rows),
                       step_timesteps=self.step_timesteps.index_select(1, text_rows),
                       modulation=(double.index_select(3, text_rows), single.index_select(2, text_rows),
                                   final.index_select(1, text_rows)))


@dataclass
class FluxStepInput:
    """One state's transformer rows at its step (`FluxPipeline.step_inputs`): one entry per row each."""

    x: torch.Tensor = rows()
    embeds: torch.Tensor = rows(text=True)
    pooled: torch.Tensor = rows(text=True)
    timestep: torch.Tensor = rows(text=True)
    guidance: torch.Tensor | None = rows(text=True)
    double_modulation: torch.Tensor = rows(dim=2, text=True)
    single_modulation: torch.Tensor = rows(dim=1, text=True)
    final_modulation: torch.Tensor = rows(text=True)
    """This step's adaLN parameters per row (`FluxTransformer2DModel.step_slice`)."""
    rotary_emb: Any
    """The same for all rows (same grid and text length)."""


class FluxPipeline(NativeDiffusionPipeline):
    progress_desc: ClassVar[str] = "FLUX denoise"
    compile_vae_decoder: ClassVar[bool] = True
    lora_loader: ClassVar[str | None] = "FluxLoraLoaderMixin"

    def __init__(self, *, od_config: OmniDiffusionConfig, transformer: FluxTransformer2DModel, text_encoder,
                 text_encoder_2, tokenizer, tokenizer_2, vae, scheduler, device: torch.device, dtype: torch.dtype):
        super().__init__()
        from diffusers.image_processor import VaeImageProcessor

        self.od_config = od_config
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.vae = vae
        self.tokenizer = tokenizer
        self.tokenizer_2 = tokenizer_2
        self.scheduler = scheduler
        """Holds the checkpoint's scheduler config; each group of requests steps a fresh copy (`make_scheduler`)."""
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.latent_channels = transformer.x_embedder.in_features // 4

    @classmethod
    def from_pretrained(cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device,
                        dtype: torch.dtype) -> FluxPipeline:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        model_dir = Path(model_dir)
        transformer = load_native_transformer(FluxTransformer2DModel, model_dir, "transformer", od_config, device,
                                              dtype)
        load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
        text_encoder = load(CLIPTextModel, model_dir / "text_encoder")
        text_encoder_2 = load(T5EncoderModel, model_dir / "text_encoder_2")
        vae = load(AutoencoderKL, model_dir / "vae")
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler")
        return cls(od_config=od_config, transformer=transformer, text_encoder=text_encoder,
                   text_encoder_2=text_encoder_2, tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
                   tokenizer_2=AutoTokenizer.from_pretrained(model_dir / "tokenizer_2"), vae=vae,
                   scheduler=scheduler, device=device, dtype=dtype)

    def cache_presets(self) -> FamilyPresets:
        return PRESETS

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        """Requests sharing every parameter but prompt, negative prompt and seed run in one forward."""
        sp = request.sampling_params
        return (sp.height, sp.width, sp.num_inference_steps, sp.guidance_scale, sp.true_cfg_scale,
                sp.num_outputs_per_prompt, sp.output_type, sp.max_sequence_length)

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> FluxConditioning:
        """Latent grid, then the prompts and (true CFG) the negatives of the requests that have one."""
        sp = requests[0].sampling_params
        n = sp.num_outputs_per_prompt
        height = sp.height or 128 * self.vae_scale_factor
        width = sp.width or 128 * self.vae_scale_factor
        true_cfg = sp.true_cfg_scale or 1.0
        cfg_requests = [i for i, r in enumerate(requests) if true_cfg > 1 and r.negative_prompt is not None]
        prompts = [r.prompt_text for r in requests] + [requests[i].negative_prompt for i in cfg_requests]
        embeds, pooled = self.encode_texts(prompts, sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH)
        neg_rows = torch.tensor([i * n + j for i in cfg_requests for j in range(n)], device=self.device,
                                dtype=torch.long)
        cfg = CFG(true_cfg, uncond=neg_rows) if len(neg_rows) else None
        # Latent grid: VAE downsampling, then rounded down to even so 2x2 patches tile it (as diffusers does).
        return FluxConditioning(embeds.repeat_interleave(n, dim=0), pooled.repeat_interleave(n, dim=0), cfg,
                                2 * (height // (self.vae_scale_factor * 2)),
                                2 * (width // (self.vae_scale_factor * 2)))

    def prepare_latents(self, requests: list[OmniDiffusionRequest], conditioning: FluxConditioning
                        ) -> torch.Tensor:
        """Gaussian latents per request from a CPU generator, the way diffusers' randn_tensor draws them."""
        n, lh, lw = requests[0].sampling_params.num_outputs_per_prompt, conditioning.lh, conditioning.lw
        noise = []
        for request in requests:
            seed = request.sampling_params.seed
            generator = torch.Generator(device="cpu").manual_seed(shared_random_seed() if seed is None else seed)
            noise.append(torch.randn((n, self.latent_channels, lh, lw), generator=generator, dtype=self.dtype))
        return pack_latents(torch.cat(noise).to(self.device))

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        """A fresh FlowMatchEulerDiscreteScheduler with diffusers' sigmas and resolution-dependent shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = requests[0].sampling_params.num_inference_steps or DEFAULT_STEPS
        cfg = self.scheduler.config
        mu = calculate_shift(latents.shape[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sigmas = None if cfg.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        scheduler.set_timesteps(steps, device=self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def prepare_step_tables(self, state: DenoiseState) -> None:
        """Guidance, rotary embedding, and every step's adaLN parameters from the timesteps exactly as each step
        passes them."""
        cond = state.conditioning
        rows = cond.embeds.shape[0]
        if self.transformer.guidance_embeds:
            guidance = state.requests[0].sampling_params.guidance_scale
            guidance = DEFAULT_GUIDANCE if guidance is None else guidance
            cond.guidance = torch.full((rows,), guidance, device=self.device, dtype=torch.float32)
        txt_ids = torch.zeros(cond.embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        img_ids = latent_image_ids(cond.lh // 2, cond.lw // 2).to(self.device, self.dtype)
        cond.rotary_emb = self.transformer.rotary_emb(txt_ids, img_ids)
        cond.step_timesteps = state.timesteps[:, None].expand(-1, rows).to(state.latents.dtype) / 1000
        cond.modulation = self.transformer.step_modulation(cond.step_timesteps, cond.guidance, cond.pooled,
                                                           self.dtype)

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same latent grid, text length (`max_sequence_length`) and dtype; CFG, scales and steps may differ."""
        cond = state.conditioning
        return cond.lh, cond.lw, cond.embeds.shape[1], state.latents.dtype

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        return cond.embeds.shape[0] * (state.latents.shape[1] + cond.embeds.shape[1])

    def step_inputs(self, state: DenoiseState) -> FluxStepInput:
        """The latent rows; this step's timesteps and adaLN rows of every transformer row (the true-CFG rows'
        negatives included)."""
        cond, latents, i = state.conditioning, state.latents, state.step_index
        return FluxStepInput(latents, cond.embeds, cond.pooled, cond.step_timesteps[i], cond.guidance,
                             *self.transformer.step_slice(cond.modulation, i), cond.rotary_emb)

    def transformer_forward(self, inp: FluxStepInput, call: Callable[..., Any]) -> torch.Tensor:
        """Equal text lengths in a co-batch (T5 pads to `max_sequence_length`); each row with its own step's
        modulation."""
        return call("transformer", inp.x, inp.embeds, inp.pooled, inp.timestep, guidance=inp.guidance,
                    rotary_emb=inp.rotary_emb,
                    modulation=(inp.double_modulation, inp.single_modulation, inp.final_modulation))

    def decode(self, state: DenoiseState) -> list[Any]:
        if state.requests[0].sampling_params.output_type == "latent":
            return list(state.latents.cpu())
        cond = state.conditioning
        latents = unpack_latents(state.latents, cond.lh, cond.lw)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(latents, return_dict=False)[0]
        return list(self.image_processor.postprocess(image, output_type=state.requests[0].sampling_params.output_type))

    @torch.inference_mode()
    def encode_texts(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 hidden states (B, L, D), pooled CLIP embedding (B, P)), both padded to fixed lengths."""
        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        pooled = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                                  return_tensors="pt").input_ids
        embeds = self.text_encoder_2(t5_ids.to(self.device), output_hidden_states=False)[0]
        return embeds.to(self.text_encoder_2.dtype), pooled.to(self.text_encoder.dtype)
