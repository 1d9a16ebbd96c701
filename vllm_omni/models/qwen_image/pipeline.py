"""Qwen-Image text-to-image: Qwen2.5-VL prompt encoder -> MMDiT flow matching -> Qwen-Image VAE.

Numerically this is diffusers' `QwenImagePipeline`; what differs is how work is batched: all prompts of a
request batch (and their negatives, for true CFG) go through the text encoder together, and positive and
negative rows run through the transformer in ONE forward, text padded to a common length (each row then attends
over its own real tokens only, without a mask: see `QwenJointAttention`).
Each request draws its initial noise from its own seeded CPU generator exactly as diffusers does, so a
request gives the same image alone, in a batch, or in diffusers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np
import torch
from torch import nn

from vllm_omni.diffusion.cache.policy import FamilyPresets
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.distributed.parallel_state import shared_random_seed
from vllm_omni.diffusion.distributed.vae_patch import patch_parallel_decode, vae_patch_group
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, pad_text, prompt_rows, rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.models.qwen_image.cache import PRESETS
from vllm_omni.models.qwen_image.transformer import QwenImageTransformer2DModel

DEFAULT_NUM_INFERENCE_STEPS = 50
DEFAULT_TRUE_CFG_SCALE = 4.0
DEFAULT_MAX_SEQUENCE_LENGTH = 512
MAX_SEQUENCE_LENGTH = 1024


@dataclass
class PromptEmbeds:
    """Text conditioning for every transformer row: embeddings (rows, seq, dim), zero-padded at the end."""

    embeds: torch.Tensor
    lengths: tuple[int, ...]
    """Real text tokens of each row."""


@dataclass
class Geometry:
    height: int
    width: int
    img_shapes: list[tuple[int, int, int]]
    """(frames, height, width) in 2x2 patches of the generated image, then of any condition image."""


@dataclass
class QwenConditioning(Conditioning):
    """What the transformer rows of one group are conditioned on besides latents and timestep."""

    prompt: PromptEmbeds
    """Rows: one per latent row, then (true CFG) the negatives in the same order."""
    geometry: Geometry
    cfg: CFG | None
    image_latents: torch.Tensor | None = None
    """Edit: packed VAE latents of the input image, one row per latent row, appended to its tokens."""
    modulation: torch.Tensor | None = None
    """Every step's adaLN parameters (num_layers, 2, steps, 6 * dim); the same for all rows."""

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> QwenConditioning:
        """Keeps `rows` (and their negatives), text cut to the longest kept prompt as if encoded alone."""
        lengths = tuple(self.prompt.lengths[i] for i in text_rows.tolist())
        embeds = self.prompt.embeds.index_select(0, text_rows)[:, :max(lengths)]
        image_latents = None if self.image_latents is None else self.image_latents.index_select(0, rows)
        return replace(self, prompt=PromptEmbeds(embeds, lengths), image_latents=image_latents)


@dataclass
class QwenStepInput:
    """One state's transformer rows at its step (`QwenImagePipeline.step_inputs`)."""

    x: torch.Tensor = rows()
    embeds: torch.Tensor = rows(pad=1, text=True)
    """Text embeddings (rows, seq, dim), zero-padded at the end."""
    lengths: tuple[int, ...] = rows(text=True)
    """Real text tokens of each row."""
    timestep: torch.Tensor = rows()
    """(rows,) in [0, 1]."""
    modulation: torch.Tensor = rows(dim=2, shared=True)
    """This step's adaLN parameters (num_layers, 2, 1, 6 * dim): one entry, the same for the state's rows."""
    img_shapes: list[tuple[int, int, int]]
    img_len: int
    """Generated-image tokens per row (condition tokens follow them)."""


class QwenImagePipeline(NativeDiffusionPipeline):
    progress_desc: ClassVar[str] = "Qwen-Image denoise"
    compile_vae_decoder: ClassVar[bool] = True
    lora_loader: ClassVar[str | None] = "QwenImageLoraLoaderMixin"
    prompt_template: ClassVar[str] = (
        "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
        "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    prompt_template_drop_tokens: ClassVar[int] = 34
    """Template tokens before the user's text; their hidden states are dropped."""
    default_sample_size: ClassVar[int] = 128

    def __init__(self, *, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype,
                 tokenizer: Any, text_encoder: nn.Module, transformer: QwenImageTransformer2DModel, vae: nn.Module,
                 scheduler_config: dict[str, Any], vl_image_processor: Any = None) -> None:
        super().__init__()
        from diffusers.image_processor import VaeImageProcessor

        self.od_config = od_config
        self.device = device
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.vae = vae
        self.scheduler_config = scheduler_config
        self.vae_scale_factor = 2 ** len(vae.temperal_downsample)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.vl_image_processor = vl_image_processor
        """Qwen2-VL image processor (Edit only: the input image goes to the text encoder too)."""

    # ---- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device,
                        dtype: torch.dtype) -> Self:
        from vllm_omni.models.qwen_image.loading import load_qwen_image_components

        components = load_qwen_image_components(od_config, Path(model_dir), device, dtype,
                                                with_processor=cls.needs_processor())
        return cls(od_config=od_config, device=device, dtype=dtype, **components)

    @classmethod
    def needs_processor(cls) -> bool:
        return False

    def cache_presets(self) -> FamilyPresets:
        return PRESETS

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        """Validates the request; requests with equal keys run in one forward."""
        if not request.prompt_text.strip():
            raise OmniClientError("prompt must be a non-empty string", param="prompt")
        sp = request.sampling_params
        shared = (sp.height, sp.width, sp.num_inference_steps, sp.true_cfg_scale, sp.num_outputs_per_prompt,
                  sp.output_type, sp.max_sequence_length)
        return self.true_cfg(request) is not None, shared

    def true_cfg(self, request: OmniDiffusionRequest) -> CFG | None:
        """True CFG against the negative prompt, when the request has one and a scale above 1."""
        scale = request.sampling_params.true_cfg_scale
        scale = DEFAULT_TRUE_CFG_SCALE if scale is None else scale
        return CFG(scale) if scale > 1 and request.negative_prompt is not None else None

    def check_inputs(self, requests: list[OmniDiffusionRequest]) -> None:
        max_len = requests[0].sampling_params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        if max_len > MAX_SEQUENCE_LENGTH:
            raise OmniClientError(f"max_sequence_length cannot be greater than {MAX_SEQUENCE_LENGTH}, got {max_len}",
                                  param="max_sequence_length")

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> QwenConditioning:
        """Output size and latent grid, then positive prompts (and negatives for true CFG) in one encoder batch."""
        sp = requests[0].sampling_params
        geometry = self.resolve_geometry(sp)
        cfg = self.true_cfg(requests[0])
        texts = [text for text, _ in prompt_rows(requests, cfg)]
        max_len = sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        prompt = self.encode_texts(texts, max_len, sp.num_outputs_per_prompt)
        return QwenConditioning(prompt, geometry, cfg)

    def prepare_latents(self, requests: list[OmniDiffusionRequest], conditioning: QwenConditioning
                        ) -> torch.Tensor:
        """Noise per request from its own CPU generator: the draw diffusers makes for that seed."""
        h, w = conditioning.geometry.img_shapes[0][1:]
        channels = self.transformer.config.in_channels // 4
        noise = []
        for request in requests:
            sp = request.sampling_params
            seed = shared_random_seed() if sp.seed is None else sp.seed
            generator = torch.Generator(device="cpu").manual_seed(seed)
            shape = (sp.num_outputs_per_prompt, 1, channels, 2 * h, 2 * w)  # diffusers' draw shape
            draw = torch.randn(shape, generator=generator, dtype=self.dtype)
            noise.append(self.pack_latents(draw.view(shape[0], channels, 2 * h, 2 * w)))
        return torch.cat(noise).to(self.device)

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        """A fresh FlowMatchEulerDiscreteScheduler with diffusers' sigmas and resolution-dependent shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        steps = requests[0].sampling_params.num_inference_steps or DEFAULT_NUM_INFERENCE_STEPS
        cfg = self.scheduler_config
        base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
        base_shift, max_shift = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
        slope = (max_shift - base_shift) / (max_len - base_len)
        mu = latents.shape[1] * slope + (base_shift - slope * base_len)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def prepare_step_tables(self, state: DenoiseState) -> None:
        # The timesteps exactly as each step passes them (cast first, then scaled, as diffusers does).
        dtype = state.latents.dtype
        state.conditioning.modulation = self.transformer.step_modulation(state.timesteps.to(dtype) / 1000, dtype)

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same image (and condition image) grid and dtype; prompt lengths, CFG, scales and steps may differ."""
        return tuple(state.conditioning.geometry.img_shapes), state.latents.dtype

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        image_tokens = sum(f * h * w for f, h, w in cond.geometry.img_shapes)
        return self.transformer_rows(state) * (image_tokens + cond.prompt.embeds.shape[1])

    def step_inputs(self, state: DenoiseState) -> QwenStepInput:
        """The latent rows, condition tokens (Edit) appended to each; this step's timestep and adaLN row."""
        cond, latents, i = state.conditioning, state.latents, state.step_index
        x = latents if cond.image_latents is None else torch.cat([latents, cond.image_latents], dim=1)
        timestep = state.timesteps[i].expand(x.shape[0]).to(latents.dtype) / 1000
        return QwenStepInput(x, cond.prompt.embeds, cond.prompt.lengths, timestep, cond.modulation[:, :, i : i + 1],
                             cond.geometry.img_shapes, latents.shape[1])

    def transformer_forward(self, inp: QwenStepInput, call: Callable[..., Any]) -> torch.Tensor:
        """Text zero-padded to the longest row, each row attending over its real tokens (`txt_lengths`), each
        row with its own step's modulation; the generated image's tokens of the prediction. Compiled path: text
        padded to its length bucket under a key mask, so the CUDA graph does not depend on prompt lengths."""
        if self.text_buckets and self.transformer.masks_on_device:
            embeds, mask = pad_text(inp.embeds, inp.lengths, self.text_buckets)
            return call("transformer", inp.x, embeds, mask, inp.timestep, inp.img_shapes,
                        inp.modulation)[:, :inp.img_len]
        return call("transformer", inp.x, inp.embeds, None, inp.timestep, inp.img_shapes, inp.modulation,
                    inp.lengths)[:, :inp.img_len]

    def warmup_text_lengths(self) -> list[int]:
        buckets = [b for b in self.text_buckets if b <= DEFAULT_MAX_SEQUENCE_LENGTH]
        return [b * 3 // 4 for b in buckets]

    def warmup_guided(self) -> bool:
        return True  # a negative prompt turns true CFG on (DEFAULT_TRUE_CFG_SCALE)

    def combine_cfg(self, state: DenoiseState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """CFG combination rescaled to the conditional prediction's per-token norm (as Qwen-Image does)."""
        combined = super().combine_cfg(state, cond, uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, state: DenoiseState) -> Any:
        if state.requests[0].sampling_params.output_type == "latent":
            return state.latents
        latents = self.unpack_latents(state.latents, state.conditioning.geometry).to(self.vae.dtype)
        latents = self.normalize_latents(latents, inverse=True)
        group = vae_patch_group()
        image = (self.vae.decode(latents, return_dict=False)[0] if group is None
                 else patch_parallel_decode(self.vae, latents, group))[:, :, 0]
        return self.image_processor.postprocess(image, output_type=state.requests[0].sampling_params.output_type)

    # ---- stages --------------------------------------------------------------------------------------------

    def resolve_geometry(self, sp: OmniDiffusionSamplingParams, default_hw: tuple[int, int] | None = None
                         ) -> Geometry:
        default = self.default_sample_size * self.vae_scale_factor
        height = sp.height or (default_hw[0] if default_hw else default)
        width = sp.width or (default_hw[1] if default_hw else default)
        multiple = self.vae_scale_factor * 2
        for name, value in (("height", sp.height), ("width", sp.width)):
            if value is not None and value % multiple:
                raise OmniClientError(f"{name} must be a multiple of {multiple} for Qwen-Image, got {value}",
                                      param=name)
        height, width = height // multiple * multiple, width // multiple * multiple
        return Geometry(height, width, [(1, height // multiple, width // multiple)])

    def text_encoder_inputs(self, texts: list[str], images: list[Any] | None = None) -> dict[str, torch.Tensor]:
        formatted = [self.prompt_template.format(t) for t in texts]
        tokens = self.tokenizer(formatted, max_length=MAX_SEQUENCE_LENGTH + self.prompt_template_drop_tokens,
                                padding=True, truncation=True, return_tensors="pt")
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}

    def encode_texts(self, texts: list[str], max_len: int | None, per_prompt: int,
                     images: list[Any] | None = None) -> PromptEmbeds:
        """Last hidden states of each text's real tokens after the template, zero-padded to a common length."""
        inputs = {k: v.to(self.device) for k, v in self.text_encoder_inputs(texts, images).items()}
        hidden = self.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]
        token_mask = inputs["attention_mask"].bool()
        rows = [h[m][self.prompt_template_drop_tokens:] for h, m in zip(hidden, token_mask, strict=True)]
        if max_len is not None:
            rows = [r[:max_len] for r in rows]
        seq = max(r.shape[0] for r in rows)
        embeds = hidden.new_zeros(len(rows), seq, hidden.shape[-1])
        for i, row in enumerate(rows):
            embeds[i, : row.shape[0]] = row
        embeds = embeds.to(self.dtype).repeat_interleave(per_prompt, dim=0)
        return PromptEmbeds(embeds, tuple(row.shape[0] for row in rows for _ in range(per_prompt)))

    @staticmethod
    def pack_latents(latents: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/2 * W/2, C*4): 2x2 patches as tokens."""
        b, c, h, w = latents.shape
        x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // 2) * (w // 2), c * 4)

    def unpack_latents(self, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        b, _, channels = latents.shape
        h, w = geometry.img_shapes[0][1:]
        x = latents.view(b, h, w, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, channels // 4, 1, 2 * h, 2 * w)

    def normalize_latents(self, latents: torch.Tensor, *, inverse: bool) -> torch.Tensor:
        """Between the DiT's normalized latent space and the VAE's (per-channel mean / std of the VAE)."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / (1.0 / std) + mean if inverse else (latents - mean) / std

