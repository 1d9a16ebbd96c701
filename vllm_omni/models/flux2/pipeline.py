"""FLUX.2 [klein] text-to-image: Qwen3 prompt encoder -> FLUX.2 MMDiT -> flow-matching Euler -> AutoencoderKLFlux2.

Numerically diffusers' `Flux2KleinPipeline` (chat-templated prompt padded to `max_sequence_length`, hidden states
of Qwen3 layers 9, 18 and 27 side by side, the same noise for the same seed, linear sigmas with FLUX.2's
empirical resolution- and step-dependent shift, latents in the VAE's batch-norm-normalized 2 x 2-patch space).
Defaults follow the checkpoint: a step-distilled repo (`is_distilled` in model_index.json, FLUX.2-klein-4B/9B)
runs 4 steps without CFG, as its model card does; a base repo 50 steps with CFG 4 against the empty prompt.

Reference images (edits, `multi_modal_data.image`: one image or a list) are VAE-encoded once per request and
appended to the generated image's tokens in every row, each at its own RoPE time coordinate (10, 20, ...); the
prediction for them is dropped, as diffusers does. Without a size, the output takes the first image's.
"""

from __future__ import annotations

import functools
import json
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
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, prompt_rows, rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.errors import OmniClientError
from vllm_omni.models.flux2.cache import PRESETS
from vllm_omni.models.flux2.transformer import Flux2Transformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

DISTILLED_STEPS = 4
BASE_STEPS = 50
BASE_GUIDANCE = 4.0
DEFAULT_SIZE = 1024
DEFAULT_MAX_SEQUENCE_LENGTH = 512
TEXT_LAYERS = (9, 18, 27)


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's timestep shift: linear in the image tokens, interpolated in the step count below 4300 tokens."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + m_200 - 200.0 * a)


def grid_ids(h: int, w: int, t: int = 0) -> torch.Tensor:
    """(h * w, 4) positions (t, row, col, 0) of a packed latent grid."""
    ids = torch.zeros(h, w, 4)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 4)


@dataclass
class Flux2Conditioning(Conditioning):
    """Text rows: one per latent row, then (CFG) one negative per latent row in the same order."""

    embeds: torch.Tensor
    cfg: CFG | None
    guidance: float
    """The embedded guidance of a guidance-distilled transformer (FLUX.2 [dev])."""
    lh: int
    lw: int
    """Packed latent grid (2 x 2 VAE-latent patches)."""
    ref_latents: torch.Tensor | None = None
    """Packed, normalized VAE latents of the reference images (rows, tokens, channels), one row per latent row."""
    ref_grids: tuple[tuple[int, int], ...] = ()
    """Each reference image's packed latent grid."""
    rotary_emb: Any = None

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> Flux2Conditioning:
        ref = None if self.ref_latents is None else self.ref_latents.index_select(0, rows)
        return replace(self, embeds=self.embeds.index_select(0, text_rows), ref_latents=ref)


@dataclass
class Flux2StepInput:
    x: torch.Tensor = rows()
    embeds: torch.Tensor = rows(text=True)
    timestep: torch.Tensor = rows()
    """(rows,) in [0, 1]."""
    guidance: torch.Tensor | None = rows()
    """(rows,) embedded guidance of a guidance-distilled transformer (FLUX.2 [dev]); None for klein."""
    rotary_emb: Any
    """The same for all rows (same grids and text length)."""
    img_len: int
    """Generated-image tokens per row (reference tokens follow them)."""


class Flux2KleinPipeline(NativeDiffusionPipeline):
    progress_desc: ClassVar[str] = "FLUX.2 klein denoise"
    compile_vae_decoder: ClassVar[bool] = True

    def __init__(
        self,
        *,
        od_config: OmniDiffusionConfig,
        transformer: Flux2Transformer2DModel,
        text_encoder,
        tokenizer,
        vae,
        scheduler_config: dict[str, Any],
        is_distilled: bool,
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        self.od_config = od_config
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.vae = vae
        self.scheduler_config = scheduler_config
        self.is_distilled = is_distilled
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.image_processor = Flux2ImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    @classmethod
    def from_pretrained(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> Flux2KleinPipeline:
        from diffusers import AutoencoderKLFlux2
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        model_dir = Path(model_dir)
        load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
        index = json.loads((model_dir / "model_index.json").read_text())
        return cls(
            od_config=od_config,
            transformer=load_native_transformer(
                Flux2Transformer2DModel, model_dir, "transformer", od_config, device, dtype
            ),
            text_encoder=load(Qwen3ForCausalLM, model_dir / "text_encoder"),
            tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
            vae=load(AutoencoderKLFlux2, model_dir / "vae"),
            scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
            is_distilled=bool(index.get("is_distilled", False)),
            device=device,
            dtype=dtype,
        )

    def cache_presets(self) -> FamilyPresets:
        return PRESETS

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        if not request.prompt_text.strip():
            raise OmniClientError("prompt must be a non-empty string", param="prompt")
        sp = request.sampling_params
        if sp.true_cfg_scale is not None:
            raise OmniClientError(
                "FLUX.2 klein's classifier-free guidance is guidance_scale (> 1 turns it on); "
                "true_cfg_scale is not a FLUX.2 klein parameter",
                param="true_cfg_scale",
            )
        if self.is_distilled and request.negative_prompt is not None:
            raise OmniClientError(
                "negative_prompt is not used by a step-distilled FLUX.2 klein checkpoint (no CFG)",
                param="negative_prompt",
            )
        if self.is_distilled and sp.guidance_scale is not None and sp.guidance_scale > 1:
            raise OmniClientError(
                f"this FLUX.2 klein checkpoint is step-distilled and runs without guidance; "
                f"guidance_scale={sp.guidance_scale} would not be used",
                param="guidance_scale",
            )
        return (
            sp.height,
            sp.width,
            sp.num_inference_steps,
            sp.guidance_scale,
            sp.num_outputs_per_prompt,
            sp.output_type,
            sp.max_sequence_length,
            tuple(tuple(image.shape[2:]) for image in self.reference_images(request)),
        )

    def reference_images(self, request: OmniDiffusionRequest) -> list[torch.Tensor]:
        """The request's reference images as diffusers prepares them: at most 1024^2 pixels, cropped to multiples
        of 16, as (1, 3, H, W) tensors in [-1, 1]."""
        images = request.multi_modal_data.get("image") if request.multi_modal_data else None
        if images is None:
            return []
        out = []
        for image in images if isinstance(images, list | tuple) else [images]:
            try:
                image = self.image_processor.check_image_input(image)
            except ValueError as exc:
                raise OmniClientError(f"reference image: {exc}", param="image") from exc
            if image.width * image.height > 1024 * 1024:
                image = self.image_processor._resize_to_target_area(image, 1024 * 1024)
            multiple = self.vae_scale_factor * 2
            width, height = image.width // multiple * multiple, image.height // multiple * multiple
            out.append(self.image_processor.preprocess(image, height=height, width=width, resize_mode="crop"))
        return out

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> Flux2Conditioning:
        """Packed latent grid, then the prompts and (CFG) their negatives ("" unless given) in one batch."""
        sp = requests[0].sampling_params
        n = sp.num_outputs_per_prompt
        guidance = self.default_guidance if sp.guidance_scale is None else sp.guidance_scale
        guided = not self.is_distilled and not self.transformer.guidance_embeds and guidance > 1
        cfg = CFG(guidance) if guided else None
        texts = [text for text, _ in prompt_rows(requests, cfg)]
        embeds = self.encode_texts(texts, sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH)
        factor = self.vae_scale_factor * 2
        refs = [self.reference_images(r) for r in requests]
        first = refs[0][0].shape[2:] if refs[0] else (DEFAULT_SIZE, DEFAULT_SIZE)
        lh, lw = ((size or default) // factor for size, default in zip((sp.height, sp.width), first, strict=True))
        cond = Flux2Conditioning(embeds.repeat_interleave(n, dim=0), cfg, guidance, lh, lw)
        if refs[0]:
            cond.ref_grids = tuple((image.shape[2] // factor, image.shape[3] // factor) for image in refs[0])
            cond.ref_latents = torch.cat([self.encode_references(images) for images in refs]).repeat_interleave(n, 0)
        return cond

    @torch.inference_mode()
    def encode_references(self, images: list[torch.Tensor]) -> torch.Tensor:
        """(1, tokens, channels): each image's VAE mode, 2 x 2-patched, batch-norm normalized, packed, joined."""
        bn = self.vae.bn
        packed = []
        for image in images:
            latents = self.vae.encode(image.to(self.device, self.vae.dtype)).latent_dist.mode()
            b, c, h, w = latents.shape
            latents = (
                latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)
            )
            mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
            std = std.to(latents.device, latents.dtype)
            packed.append(((latents - mean) / std).flatten(2).transpose(1, 2))
        return torch.cat(packed, dim=1).to(self.dtype)

    def prepare_latents(self, requests: list[OmniDiffusionRequest], conditioning: Flux2Conditioning) -> torch.Tensor:
        """Noise per request from its own CPU generator in diffusers' (n, 4C, h, w) draw, packed to tokens."""
        noise = []
        for request in requests:
            sp = request.sampling_params
            generator = torch.Generator("cpu").manual_seed(shared_random_seed() if sp.seed is None else sp.seed)
            shape = (sp.num_outputs_per_prompt, self.transformer.in_channels, conditioning.lh, conditioning.lw)
            noise.append(torch.randn(shape, generator=generator, dtype=self.dtype))
        return torch.cat(noise).flatten(2).transpose(1, 2).to(self.device)

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = requests[0].sampling_params.num_inference_steps or self.default_steps
        cfg = self.scheduler_config
        sigmas = None if cfg.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        scheduler.set_timesteps(steps, device=self.device, sigmas=sigmas, mu=empirical_mu(latents.shape[1], steps))
        scheduler.set_begin_index(0)
        return scheduler

    @property
    def default_steps(self) -> int:
        return DISTILLED_STEPS if self.is_distilled else BASE_STEPS

    @property
    def default_guidance(self) -> float:
        return BASE_GUIDANCE

    def prepare_step_tables(self, state: DenoiseState) -> None:
        cond = state.conditioning
        txt_ids = grid_ids(1, 1).repeat(cond.embeds.shape[1], 1)
        txt_ids[:, 3] = torch.arange(cond.embeds.shape[1])
        img_ids = torch.cat(
            [grid_ids(cond.lh, cond.lw)] + [grid_ids(h, w, 10 + 10 * i) for i, (h, w) in enumerate(cond.ref_grids)]
        )
        cond.rotary_emb = self.transformer.rotary_emb(txt_ids.to(self.device), img_ids.to(self.device))

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same grid, text length (`max_sequence_length`: prompts pad to it) and dtype; CFG, scales and steps may
        differ."""
        cond = state.conditioning
        return cond.lh, cond.lw, cond.ref_grids, cond.embeds.shape[1], state.latents.dtype

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        refs = 0 if cond.ref_latents is None else cond.ref_latents.shape[1]
        return cond.embeds.shape[0] * (state.latents.shape[1] + refs + cond.embeds.shape[1])

    def step_inputs(self, state: DenoiseState) -> Flux2StepInput:
        cond, latents = state.conditioning, state.latents.to(self.dtype)
        if cond.ref_latents is not None:
            latents = torch.cat([latents, cond.ref_latents], dim=1)
        t = state.timesteps[state.step_index].expand(latents.shape[0]).to(state.latents.dtype) / 1000
        guidance = torch.full_like(t, cond.guidance, dtype=torch.float32) if self.transformer.guidance_embeds else None
        return Flux2StepInput(latents, cond.embeds, t, guidance, cond.rotary_emb, state.latents.shape[1])

    def transformer_forward(self, inp: Flux2StepInput, call: Callable[..., Any]) -> torch.Tensor:
        return call("transformer", inp.x, inp.embeds, inp.timestep, guidance=inp.guidance, rotary_emb=inp.rotary_emb)[
            :, : inp.img_len
        ]

    def decode(self, state: DenoiseState) -> Any:
        cond = state.conditioning
        latents = state.latents.transpose(1, 2).unflatten(2, (cond.lh, cond.lw))
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        latents = latents * std + mean
        b, c4, h, w = latents.shape
        latents = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)
        output_type = state.requests[0].sampling_params.output_type
        if output_type == "latent":
            return list(latents.cpu())
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return list(self.image_processor.postprocess(image, output_type=output_type))

    @torch.inference_mode()
    def encode_texts(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """(B, max_sequence_length, 3 * hidden): Qwen3 layers 9, 18, 27 of each padded chat-templated prompt."""
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            for p in prompts
        ]
        tokens = self.tokenizer(
            texts, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        )
        out = self.text_encoder(
            input_ids=tokens.input_ids.to(self.device),
            attention_mask=tokens.attention_mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        hidden = torch.stack([out.hidden_states[k] for k in TEXT_LAYERS], dim=2)  # (B, L, 3, D)
        return hidden.flatten(2).to(self.dtype)
