"""Z-Image text-to-image: Qwen3 prompt encoder -> single-stream DiT -> flow-matching Euler -> AutoencoderKL.

Numerically diffusers' `ZImagePipeline` (same chat-templated prompt, second-to-last hidden states of its real
tokens, same noise for the same seed, same sigmas, CFG as `pos + scale * (pos - neg)` with "" as the default
negative prompt). Defaults are Z-Image-Turbo's model card: 9 steps, guidance 0 (no CFG), 1024 x 1024, so a bare
prompt gives the distilled model's intended image; the undistilled `Tongyi-MAI/Z-Image` wants
`num_inference_steps=50, guidance_scale=4` on the request.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm_omni.diffusion.cache.policy import FamilyPresets
from vllm_omni.diffusion.distributed.parallel_state import shared_random_seed
from vllm_omni.diffusion.model_loader.components import load_native_transformer
from vllm_omni.diffusion.model_loader.dummy import load_pretrained
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, prompt_rows, rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.errors import OmniClientError
from vllm_omni.models.z_image.cache import PRESETS
from vllm_omni.models.z_image.transformer import ZImageTransformer2DModel, padded

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

DEFAULT_STEPS = 9
"""Z-Image-Turbo's model card (`num_inference_steps=9`: 8 DiT forwards of the distilled schedule + the last)."""
DEFAULT_GUIDANCE = 0.0
"""Z-Image-Turbo is guidance-distilled: no CFG."""
DEFAULT_SIZE = 1024
DEFAULT_MAX_SEQUENCE_LENGTH = 512


@dataclass
class ZImageConditioning(Conditioning):
    """Text rows: one per latent row, then (CFG) one negative per latent row in the same order."""

    embeds: torch.Tensor
    """(text rows, seq, dim), each row's real tokens first, zero-padded at the end."""
    lengths: tuple[int, ...]
    cfg: CFG | None
    lh: int
    lw: int
    """Latent grid (height, width)."""

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> ZImageConditioning:
        lengths = tuple(self.lengths[i] for i in text_rows.tolist())
        return replace(self, embeds=self.embeds.index_select(0, text_rows)[:, : max(lengths)], lengths=lengths)


@dataclass
class ZImageStepInput:
    """One state's transformer rows at its step (`ZImagePipeline.step_inputs`)."""

    x: torch.Tensor = rows()
    timestep: torch.Tensor = rows()
    """(rows,) in [0, 1], 1 = noise (the DiT's convention)."""
    embeds: torch.Tensor = rows(pad=1, text=True)
    lengths: tuple[int, ...] = rows(text=True)


class ZImagePipeline(NativeDiffusionPipeline):
    progress_desc: ClassVar[str] = "Z-Image denoise"
    compile_vae_decoder: ClassVar[bool] = True

    def __init__(
        self,
        *,
        od_config: OmniDiffusionConfig,
        transformer: ZImageTransformer2DModel,
        text_encoder,
        tokenizer,
        vae,
        scheduler_config: dict[str, Any],
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        from diffusers.image_processor import VaeImageProcessor

        self.od_config = od_config
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.vae = vae
        self.scheduler_config = scheduler_config
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    @classmethod
    def from_pretrained(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> ZImagePipeline:
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, Qwen3Model

        model_dir = Path(model_dir)
        load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
        return cls(
            od_config=od_config,
            transformer=load_native_transformer(
                ZImageTransformer2DModel, model_dir, "transformer", od_config, device, dtype
            ),
            text_encoder=load(Qwen3Model, model_dir / "text_encoder"),
            tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
            vae=load(AutoencoderKL, model_dir / "vae"),
            scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
            device=device,
            dtype=dtype,
        )

    def cache_presets(self) -> FamilyPresets:
        return PRESETS

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        """Validates the request; requests sharing every parameter but prompt, negative prompt and seed run
        together."""
        if not request.prompt_text.strip():
            raise OmniClientError("prompt must be a non-empty string", param="prompt")
        sp = request.sampling_params
        if sp.true_cfg_scale is not None:
            raise OmniClientError(
                "Z-Image's classifier-free guidance is guidance_scale (> 0 turns it on); "
                "true_cfg_scale is not a Z-Image parameter",
                param="true_cfg_scale",
            )
        if request.negative_prompt is not None and not (sp.guidance_scale or DEFAULT_GUIDANCE) > 0:
            raise OmniClientError(
                "negative_prompt is read only with classifier-free guidance: set guidance_scale > 0 "
                "(Z-Image-Turbo's default is 0, no CFG)",
                param="negative_prompt",
            )
        multiple = self.vae_scale_factor * 2
        for name in ("height", "width"):
            value = getattr(sp, name)
            if value is not None and value % multiple:
                raise OmniClientError(f"{name} must be a multiple of {multiple} for Z-Image, got {value}", param=name)
        return (
            sp.height,
            sp.width,
            sp.num_inference_steps,
            sp.guidance_scale,
            sp.num_outputs_per_prompt,
            sp.output_type,
            sp.max_sequence_length,
        )

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> ZImageConditioning:
        """Latent grid, then the prompts and (CFG) their negatives ("" when a request has none) in one batch."""
        sp = requests[0].sampling_params
        n = sp.num_outputs_per_prompt
        guidance = DEFAULT_GUIDANCE if sp.guidance_scale is None else sp.guidance_scale
        cfg = CFG(guidance) if guidance > 0 else None
        texts = [text for text, _ in prompt_rows(requests, cfg)]
        embeds, lengths = self.encode_texts(texts, sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH)
        lengths = tuple(m for m in lengths for _ in range(n))
        factor = self.vae_scale_factor * 2
        lh, lw = (2 * ((size or DEFAULT_SIZE) // factor) for size in (sp.height, sp.width))
        return ZImageConditioning(embeds.repeat_interleave(n, dim=0), lengths, cfg, lh, lw)

    def prepare_latents(self, requests: list[OmniDiffusionRequest], conditioning: ZImageConditioning) -> torch.Tensor:
        """float32 noise per request from its own CPU generator (diffusers draws Z-Image latents in float32)."""
        noise = []
        for request in requests:
            sp = request.sampling_params
            generator = torch.Generator("cpu").manual_seed(shared_random_seed() if sp.seed is None else sp.seed)
            shape = (sp.num_outputs_per_prompt, self.transformer.in_channels, conditioning.lh, conditioning.lw)
            noise.append(torch.randn(shape, generator=generator, dtype=torch.float32))
        return torch.cat(noise).to(self.device)

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        """A fresh FlowMatchEulerDiscreteScheduler on diffusers' Z-Image sigmas (linear 1 -> 1/steps, then the
        checkpoint's shift)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = requests[0].sampling_params.num_inference_steps or DEFAULT_STEPS
        cfg = self.scheduler_config
        slope = (cfg.get("max_shift", 1.15) - cfg.get("base_shift", 0.5)) / (
            cfg.get("max_image_seq_len", 4096) - cfg.get("base_image_seq_len", 256)
        )
        tokens = (latents.shape[2] // 2) * (latents.shape[3] // 2)
        mu = tokens * slope + cfg.get("base_shift", 0.5) - slope * cfg.get("base_image_seq_len", 256)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=mu, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same latent grid and dtype; prompt lengths, CFG, scales and steps may differ."""
        cond = state.conditioning
        return cond.lh, cond.lw, state.latents.dtype

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        image = padded((cond.lh // 2) * (cond.lw // 2))
        return cond.embeds.shape[0] * (image + padded(cond.embeds.shape[1]))

    def step_inputs(self, state: DenoiseState) -> ZImageStepInput:
        """The latent rows with their prompts (and under CFG the negatives); this step's timestep."""
        cond, latents = state.conditioning, state.latents.to(self.dtype)
        t = state.timesteps[state.step_index].expand(latents.shape[0])
        return ZImageStepInput(latents, (1000 - t) / 1000, cond.embeds, cond.lengths)

    def transformer_forward(self, inp: ZImageStepInput, call: Callable[..., Any]) -> torch.Tensor:
        return call("transformer", inp.x, inp.timestep, inp.embeds, inp.lengths)

    def guide(self, state: DenoiseState, pred: torch.Tensor) -> torch.Tensor:
        """Guided in fp32, then negated: the DiT predicts the flow from data to noise reversed."""
        return -super().guide(state, pred.float())

    def combine_cfg(self, state: DenoiseState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """CFG as diffusers' Z-Image combines it: from the conditional prediction."""
        return cond + self.cfg_scale(state) * (cond - uncond)

    def decode(self, state: DenoiseState) -> Any:
        output_type = state.requests[0].sampling_params.output_type
        if output_type == "latent":
            return list(state.latents.cpu())
        latents = state.latents.to(self.vae.dtype) / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(latents, return_dict=False)[0]
        return list(self.image_processor.postprocess(image, output_type=output_type))

    @torch.inference_mode()
    def encode_texts(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Second-to-last hidden states of each chat-templated prompt's real tokens, zero-padded to the longest."""
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for p in prompts
        ]
        tokens = self.tokenizer(
            texts, padding="longest", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        )
        mask = tokens.attention_mask.to(self.device).bool()
        hidden = self.text_encoder(
            input_ids=tokens.input_ids.to(self.device), attention_mask=mask, output_hidden_states=True
        ).hidden_states[-2]
        lengths = tuple(mask.sum(dim=1).tolist())
        embeds = hidden.new_zeros(len(prompts), max(lengths), hidden.shape[-1])
        for i, (row, row_mask) in enumerate(zip(hidden, mask, strict=True)):
            embeds[i, : lengths[i]] = row[row_mask]
        return embeds.to(self.dtype), lengths
