"""Qwen-Image-2.1 text-to-image: Qwen3-VL prompt encoder -> block-causal single-stream DiT -> Qwen-Image-2.1 VAE.

Numerically diffusers' `QwenImage21Pipeline` with its prefix KV cache on (the same raw chat template, the last
decoder layer's hidden states before the final norm with the system tokens dropped, the same noise for the same
seed, the same sigmas and shift, true CFG as `neg + scale * (pos - neg)` when `true_cfg_scale > 1` and a
negative prompt is given). The text's K/V at every layer do not depend on the step (`transformer.py`), so
`prepare_step_tables` computes them once per request into the request's conditioning, and every step runs the
image tokens only. They belong to their state: `select` drops them with their rows, co-batched states
concatenate theirs row-wise (`rows(pad=...)`), and nothing is kept on the pipeline.
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
from vllm_omni.diffusion.pipeline_base import NativeDiffusionPipeline, rows
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import DenoiseState
from vllm_omni.errors import OmniClientError
from vllm_omni.models.qwen_image_21.cache import PRESETS
from vllm_omni.models.qwen_image_21.transformer import QwenImage21Transformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

DEFAULT_STEPS = 40
"""diffusers' default when the checkpoint's `sample_sigmas` are unset."""
DEFAULT_SIZE = 1024
MAX_PROMPT_TOKENS = 1024
SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
PROMPT_TEMPLATE = (
    f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
)
"""The raw template diffusers formats (not `apply_chat_template`: the two tokenize differently)."""


@dataclass
class QwenImage21Conditioning:
    """Text rows: one per latent row, then (CFG) one negative per latent row in the same order."""

    embeds: torch.Tensor
    """(text rows, seq, dim), each row's real tokens first, zero-padded at the end."""
    lengths: tuple[int, ...]
    do_cfg: bool
    cfg_scale: float
    grid: tuple[int, int]
    """Latent grid (height, width) in tokens (16 x 16 pixels each)."""
    prefix_kv: torch.Tensor | None = None
    """This request's text K/V at every layer (text rows, layers, 2, seq, heads, head_dim), zero-padded like
    `embeds`; set once by `prepare_step_tables`."""

    def text_rows(self, rows: torch.Tensor) -> torch.Tensor:
        num_rows = self.embeds.shape[0] // (2 if self.do_cfg else 1)
        return torch.cat([rows, rows + num_rows]) if self.do_cfg else rows

    def select(self, rows: torch.Tensor) -> QwenImage21Conditioning:
        text_rows = self.text_rows(rows)
        lengths = tuple(self.lengths[i] for i in text_rows.tolist())
        n = max(lengths)
        kv = None if self.prefix_kv is None else self.prefix_kv.index_select(0, text_rows)[:, :, :, :n]
        return replace(self, embeds=self.embeds.index_select(0, text_rows)[:, :n], lengths=lengths, prefix_kv=kv)


@dataclass
class QwenImage21StepInput:
    """One state's transformer rows at its step (`QwenImage21Pipeline.step_inputs`)."""

    x: torch.Tensor = rows()
    timestep: torch.Tensor = rows()
    """(rows,) in [0, 1], 1 = noise."""
    prefix_kv: torch.Tensor = rows(pad=3)
    prefix_lengths: tuple[int, ...] = rows()
    grid: tuple[int, int] = (0, 0)


class QwenImage21Pipeline(NativeDiffusionPipeline):
    progress_desc: ClassVar[str] = "Qwen-Image-2.1 denoise"
    lora_loader: ClassVar[str | None] = "QwenImageLoraLoaderMixin"

    def __init__(
        self,
        *,
        od_config: OmniDiffusionConfig,
        transformer: QwenImage21Transformer2DModel,
        text_encoder,
        tokenizer,
        vae,
        scheduler_config: dict[str, Any],
        sample_sigmas: list[float] | None,
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
        self.sample_sigmas = sample_sigmas
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = 16
        self.image_processor = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=vae.config.z_dim)
        system = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
        self.drop_tokens = len(tokenizer.apply_chat_template(system, tokenize=True, return_dict=False))
        """Leading system-message tokens whose hidden states are dropped (counted as diffusers counts them)."""

    @classmethod
    def from_pretrained(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> QwenImage21Pipeline:
        from diffusers import AutoencoderKLQwenImage21
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        model_dir = Path(model_dir)
        load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
        index = json.loads((model_dir / "model_index.json").read_text())
        return cls(
            od_config=od_config,
            transformer=load_native_transformer(
                QwenImage21Transformer2DModel, model_dir, "transformer", od_config, device, dtype
            ),
            text_encoder=load(Qwen3VLForConditionalGeneration, model_dir / "text_encoder"),
            tokenizer=AutoTokenizer.from_pretrained(model_dir / "processor"),
            vae=load(AutoencoderKLQwenImage21, model_dir / "vae"),
            scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
            sample_sigmas=index.get("sample_sigmas"),
            device=device,
            dtype=dtype,
        )

    def cache_presets(self) -> FamilyPresets:
        return PRESETS

    # ---- hooks of the denoise template ----------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        """Validates the request; requests sharing every parameter but prompt, negative prompt and seed run
        together."""
        sp = request.sampling_params
        if sp.guidance_scale is not None:
            raise OmniClientError(
                "Qwen-Image-2.1's classifier-free guidance is true_cfg_scale (> 1, with a "
                "negative_prompt); guidance_scale is not a Qwen-Image-2.1 parameter",
                param="guidance_scale",
            )
        do_cfg = (sp.true_cfg_scale or 1.0) > 1
        if do_cfg and request.negative_prompt is None:
            raise OmniClientError(
                "true_cfg_scale > 1 needs a negative_prompt (Qwen-Image-2.1 guides against it)", param="true_cfg_scale"
            )
        if not do_cfg and request.negative_prompt is not None:
            raise OmniClientError(
                "negative_prompt is read only with classifier-free guidance: set true_cfg_scale > 1",
                param="negative_prompt",
            )
        if self.sample_sigmas is not None and sp.num_inference_steps not in (None, len(self.sample_sigmas)):
            raise OmniClientError(
                f"this checkpoint samples on its own {len(self.sample_sigmas)} sigmas "
                "(model_index.json sample_sigmas); num_inference_steps cannot change them",
                param="num_inference_steps",
            )
        for name in ("height", "width"):
            value = getattr(sp, name)
            if value is not None and value % 32:
                raise OmniClientError(f"{name} must be a multiple of 32 for Qwen-Image-2.1, got {value}", param=name)
        return (
            sp.height,
            sp.width,
            sp.num_inference_steps,
            sp.true_cfg_scale,
            sp.num_outputs_per_prompt,
            sp.output_type,
        )

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> QwenImage21Conditioning:
        """Latent grid, then the prompts and (CFG) their negatives in one encoder batch."""
        sp = requests[0].sampling_params
        n = sp.num_outputs_per_prompt
        do_cfg = (sp.true_cfg_scale or 1.0) > 1
        texts = [r.prompt_text for r in requests] + ([r.negative_prompt for r in requests] if do_cfg else [])
        embeds, lengths = self.encode_texts(texts)
        lengths = tuple(m for m in lengths for _ in range(n))
        grid = tuple((size or DEFAULT_SIZE) // 16 for size in (sp.height, sp.width))
        return QwenImage21Conditioning(
            embeds.repeat_interleave(n, dim=0), lengths, do_cfg, sp.true_cfg_scale or 1.0, grid
        )

    def prepare_latents(
        self, requests: list[OmniDiffusionRequest], conditioning: QwenImage21Conditioning
    ) -> torch.Tensor:
        """Noise per request from its own CPU generator, in diffusers' draw shape (rows, 1, C, h, w), packed to
        (rows, h * w, C)."""
        h, w = conditioning.grid
        channels = self.transformer.in_channels
        noise = []
        for request in requests:
            sp = request.sampling_params
            generator = torch.Generator("cpu").manual_seed(shared_random_seed() if sp.seed is None else sp.seed)
            draw = torch.randn((sp.num_outputs_per_prompt, 1, channels, h, w), generator=generator, dtype=self.dtype)
            noise.append(draw.view(-1, channels, h * w).transpose(1, 2))
        return torch.cat(noise).to(self.device)

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        """A fresh FlowMatchEulerDiscreteScheduler on the checkpoint's sigmas (or diffusers' linear 1 -> 1/steps)
        with the resolution-dependent shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = requests[0].sampling_params.num_inference_steps or DEFAULT_STEPS
        sigmas = self.sample_sigmas if self.sample_sigmas is not None else np.linspace(1.0, 1 / steps, steps)
        cfg = self.scheduler_config
        base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
        base_shift, max_shift = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
        slope = (max_shift - base_shift) / (max_len - base_len)
        mu = latents.shape[1] * slope + (base_shift - slope * base_len)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        scheduler.set_timesteps(sigmas=sigmas, mu=mu, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def prepare_step_tables(self, state: DenoiseState) -> None:
        """The text K/V of every row, once for all steps: each text alone, at its own length."""
        cond = state.conditioning
        kv = None
        for i, n in enumerate(cond.lengths):
            row = self.transformer.prefix_kv(cond.embeds[i : i + 1, :n])
            if kv is None:
                kv = row.new_zeros(len(cond.lengths), *row.shape[1:3], cond.embeds.shape[1], *row.shape[4:])
            kv[i, :, :, :n] = row[0]
        cond.prefix_kv = kv

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same latent grid and dtype; prompts (and their lengths), CFG, scales and steps may differ."""
        return state.conditioning.grid, state.latents.dtype

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        h, w = cond.grid
        return cond.embeds.shape[0] * h * w

    def step_inputs(self, state: DenoiseState) -> QwenImage21StepInput:
        """Positive rows, then (CFG) the same latents against the negative prompts' K/V; this step's timestep."""
        cond, latents = state.conditioning, state.latents
        x = torch.cat([latents, latents]) if cond.do_cfg else latents
        t = state.timesteps[state.step_index].expand(x.shape[0]).to(latents.dtype)
        return QwenImage21StepInput(x, t / 1000, cond.prefix_kv, cond.lengths, cond.grid)

    def transformer_forward(self, inp: QwenImage21StepInput, call: Callable[..., Any]) -> torch.Tensor:
        return call("transformer", inp.x, inp.timestep, inp.prefix_kv, inp.prefix_lengths, inp.grid)

    def guide(self, state: DenoiseState, pred: torch.Tensor) -> torch.Tensor:
        cond, rows = state.conditioning, state.latents.shape[0]
        if not cond.do_cfg:
            return pred
        pos, neg = pred[:rows], pred[rows:]
        return neg + cond.cfg_scale * (pos - neg)

    def decode(self, state: DenoiseState) -> Any:
        output_type = state.requests[0].sampling_params.output_type
        if output_type == "latent":
            return list(state.latents.cpu())
        (h, w), cfg = state.conditioning.grid, self.vae.config
        latents = state.latents.transpose(1, 2).reshape(-1, cfg.z_dim, 1, h, w).to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        image = self.vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
        return list(self.image_processor.postprocess(image, output_type=output_type))

    @torch.inference_mode()
    def encode_texts(self, prompts: list[str]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Each prompt alone (a padded batch would move its positions): the last decoder layer's hidden states
        before the final norm (what the DiT was trained on) of the templated prompt after the system message,
        zero-padded to the longest."""
        rows = [self.encode_text(p) for p in prompts]
        lengths = tuple(r.shape[0] for r in rows)
        embeds = rows[0].new_zeros(len(rows), max(lengths), rows[0].shape[-1])
        for i, row in enumerate(rows):
            embeds[i, : lengths[i]] = row
        return embeds.to(self.dtype), lengths

    def encode_text(self, prompt: str) -> torch.Tensor:
        input_ids = self.tokenizer(PROMPT_TEMPLATE.format(prompt or " "), return_tensors="pt").input_ids
        if input_ids.shape[1] - self.drop_tokens > MAX_PROMPT_TOKENS:
            raise OmniClientError(f"prompt is longer than {MAX_PROMPT_TOKENS} tokens", param="prompt")
        captured: list[torch.Tensor] = []
        text_model = getattr(self.text_encoder.model, "language_model", self.text_encoder.model)
        handle = text_model.norm.register_forward_hook(lambda module, args, output: captured.append(args[0]))
        try:
            self.text_encoder(input_ids=input_ids.to(self.device))
        finally:
            handle.remove()
        return captured[0][0, self.drop_tokens :]
