"""Qwen-Image-2.1 text-to-image: Qwen3-VL prompt encoder -> block-causal single-stream DiT -> Qwen-Image-2.1 VAE.

Numerically diffusers' `QwenImage21Pipeline` with its prefix KV cache on (the same raw chat templates, the last
decoder layer's hidden states before the final norm with the system tokens dropped, the same noise for the same
seed, the same sigmas and shift, true CFG as `neg + scale * (pos - neg)` when `true_cfg_scale > 1` and a
negative prompt is given). Condition images (`multi_modal_data.image`, /v1/images/edits) are resized to about
1024 x 1024 at their aspect ratio, seen by the text encoder in their vision slots and, as VAE latents, put into
those slots of the prefix. The prefix's K/V at every layer do not depend on the step (`transformer.py`), so
`encode_prompt` computes them once per request into the request's conditioning, and every step runs the target's
tokens only. They belong to their state: `select` drops them with their rows, co-batched states concatenate
theirs row-wise (`rows(pad=...)`), and nothing is kept on the pipeline.
"""

from __future__ import annotations

import functools
import json
import math
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
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PROMPT_TEMPLATE = PROMPT_TEMPLATE.replace("user\n{}", "user\n{images}{}")
CONDITION_AREA = 1024 * 1024
"""diffusers' `output_resolution` squared: condition images (and the default output size with them) are resized
to about this many pixels at their aspect ratio."""


def condition_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of about CONDITION_AREA pixels at the aspect ratio, multiples of 32 (as diffusers)."""
    ratio = width / height
    w = math.sqrt(CONDITION_AREA * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


@dataclass
class QwenImage21Conditioning(Conditioning):
    """Prefix rows: one per latent row, then (CFG) one negative per latent row in the same order."""

    prefix_kv: torch.Tensor
    """This request's prefix K/V at every layer (prefix rows, layers, 2, tokens, heads, head_dim), each row's
    real tokens first, zero-padded at the end; computed once, in `encode_prompt`."""
    lengths: tuple[int, ...]
    frames: tuple[int, ...]
    """The target's frame position after each row's prefix."""
    cfg: CFG | None
    grid: tuple[int, int]
    """Latent grid (height, width) in tokens (16 x 16 pixels each)."""

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> QwenImage21Conditioning:
        text_rows = text_rows.tolist()
        lengths = tuple(self.lengths[i] for i in text_rows)
        kv = self.prefix_kv[text_rows][:, :, :, : max(lengths)]
        return replace(self, prefix_kv=kv, lengths=lengths, frames=tuple(self.frames[i] for i in text_rows))


@dataclass
class QwenImage21StepInput:
    """One state's transformer rows at its step (`QwenImage21Pipeline.step_inputs`)."""

    x: torch.Tensor = rows()
    timestep: torch.Tensor = rows()
    """(rows,) in [0, 1], 1 = noise."""
    prefix_kv: torch.Tensor = rows(pad=3, text=True)
    prefix_lengths: tuple[int, ...] = rows(text=True)
    frames: tuple[int, ...] = rows(text=True)
    grid: tuple[int, int] = (0, 0)


class QwenImage21Pipeline(NativeDiffusionPipeline):
    progress_desc: ClassVar[str] = "Qwen-Image-2.1 denoise"
    compile_vae_decoder: ClassVar[bool] = True
    lora_loader: ClassVar[str | None] = "QwenImageLoraLoaderMixin"

    def __init__(
        self,
        *,
        od_config: OmniDiffusionConfig,
        transformer: QwenImage21Transformer2DModel,
        text_encoder,
        tokenizer,
        vl_image_processor,
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
        self.vl_image_processor = vl_image_processor
        """The image half of Qwen3VLProcessor (the whole processor needs torchvision for its video half)."""
        self.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
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
        from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

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
            vl_image_processor=AutoImageProcessor.from_pretrained(model_dir / "processor"),
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
            self.resolve_grid(sp, self.input_images(request)),
            sp.num_inference_steps,
            sp.true_cfg_scale,
            sp.num_outputs_per_prompt,
            sp.output_type,
        )

    @staticmethod
    def input_images(request: OmniDiffusionRequest) -> list[Any]:
        """The request's condition images (none: text-to-image), as RGBA like diffusers reads them."""
        from PIL import Image

        images = request.multi_modal_data.get("image")
        images = [] if images is None else list(images) if isinstance(images, list | tuple) else [images]
        for image in images:
            if not isinstance(image, Image.Image):
                raise OmniClientError("image must be one or more images", param="image")
        return [image if image.mode == "RGBA" else image.convert("RGBA") for image in images]

    @staticmethod
    def resolve_grid(sp: Any, images: list[Any]) -> tuple[int, int]:
        """Latent grid of the output: the request's size, else the last condition image's, else 1024 x 1024."""
        width, height = condition_size(*images[-1].size) if images else (DEFAULT_SIZE, DEFAULT_SIZE)
        return (sp.height or height) // 32 * 2, (sp.width or width) // 32 * 2

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> QwenImage21Conditioning:
        """Latent grid; then for each prompt and (CFG) negative, with its request's condition images, the prefix
        K/V at every layer, once for all steps: each prefix alone, at its own length."""
        sp = requests[0].sampling_params
        n = sp.num_outputs_per_prompt
        cfg = CFG(sp.true_cfg_scale) if (sp.true_cfg_scale or 1.0) > 1 else None
        images = [self.condition_images(r) for r in requests]
        prefixes = [self.encode_prefix(text, *images[i]) for text, i in prompt_rows(requests, cfg)]
        lengths = tuple(kv.shape[3] for kv, _ in prefixes for _ in range(n))
        kv = prefixes[0][0].new_zeros(len(lengths), *prefixes[0][0].shape[1:3], max(lengths), *prefixes[0][0].shape[4:])
        for i, (row, _) in enumerate(prefixes):
            kv[i * n : (i + 1) * n, :, :, : row.shape[3]] = row
        frames = tuple(frame for _, frame in prefixes for _ in range(n))
        grid = self.resolve_grid(sp, self.input_images(requests[0]))
        return QwenImage21Conditioning(kv, lengths, frames, cfg, grid)

    def condition_images(self, request: OmniDiffusionRequest) -> tuple[list[Any], list[tuple[torch.Tensor, int, int]]]:
        """The request's condition images at their condition size, for the text encoder (RGB, alpha over white),
        and their packed, normalized VAE latents (mode of the posterior) with their latent grids."""
        from PIL import Image

        vision, latents = [], []
        cfg = self.vae.config
        for image in self.input_images(request):
            width, height = condition_size(*image.size)
            resized = self.image_processor.resize(image, width=width, height=height)
            white = Image.new("RGB", resized.size, (255, 255, 255))
            white.paste(resized, mask=resized.getchannel("A"))
            vision.append(white)
            pixels = self.image_processor.preprocess(image, width=width, height=height).unsqueeze(2)
            encoded = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode()
            mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(encoded.device, encoded.dtype)
            std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(encoded.device, encoded.dtype)
            h, w = height // 16, width // 16
            packed = ((encoded - mean) / std).view(1, cfg.z_dim, h * w).transpose(1, 2)
            latents.append((packed.to(self.dtype), h, w))
        return vision, latents

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

    def step_group_key(self, state: DenoiseState) -> Any:
        """Same latent grid and dtype; prompts (and their lengths), CFG, scales and steps may differ."""
        return state.conditioning.grid, state.latents.dtype

    def step_tokens(self, state: DenoiseState) -> int:
        cond = state.conditioning
        h, w = cond.grid
        return cond.prefix_kv.shape[0] * h * w

    def step_inputs(self, state: DenoiseState) -> QwenImage21StepInput:
        """The latent rows against their prompts' K/V (the negatives' under CFG); this step's timestep."""
        cond, latents = state.conditioning, state.latents
        t = state.timesteps[state.step_index].expand(latents.shape[0]).to(latents.dtype)
        return QwenImage21StepInput(latents, t / 1000, cond.prefix_kv, cond.lengths, cond.frames, cond.grid)

    def transformer_forward(self, inp: QwenImage21StepInput, call: Callable[..., Any]) -> torch.Tensor:
        return call("transformer", inp.x, inp.timestep, inp.prefix_kv, inp.prefix_lengths, inp.frames, inp.grid)

    def warmup_guided(self) -> bool:
        return True  # true_cfg_scale > 1 with a negative prompt doubles the rows

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
    def encode_prefix(
        self, prompt: str | None, vision: list[Any], latents: list[tuple[torch.Tensor, int, int]]
    ) -> tuple[torch.Tensor, int]:
        """One prompt (with its condition images) through the text encoder, then its prefix K/V through the DiT:
        the last decoder layer's hidden states before the final norm (what the DiT was trained on) after the
        system message, each vision slot replaced by 2 x 2 of its image's latent tokens."""
        text = PROMPT_TEMPLATE.format(prompt or " ")
        inputs: dict[str, torch.Tensor] = {}
        if vision:
            slots = " ".join(f"<image{i + 1}>{IMAGE_SLOT}" for i in range(len(vision)))
            processed = self.vl_image_processor(images=vision, return_tensors="pt")
            merge = self.vl_image_processor.merge_size**2
            pieces = IMAGE_PROMPT_TEMPLATE.replace("{images}", slots).split("<|image_pad|>")
            pads = ["<|image_pad|>" * int(grid.prod() // merge) for grid in processed["image_grid_thw"]]
            text = "".join(p + pad for p, pad in zip(pieces, [*pads, ""], strict=True)).format(prompt or " ")
            inputs = {
                "pixel_values": processed["pixel_values"].to(self.device, self.dtype),
                "image_grid_thw": processed["image_grid_thw"].to(self.device),
            }
        input_ids = self.tokenizer(text, return_tensors="pt").input_ids.to(self.device)
        if input_ids.shape[1] - self.drop_tokens > MAX_PROMPT_TOKENS + sum(h * w // 4 for _, h, w in latents):
            raise OmniClientError(f"prompt is longer than {MAX_PROMPT_TOKENS} tokens", param="prompt")
        if vision:
            inputs["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        captured: list[torch.Tensor] = []
        text_model = getattr(self.text_encoder.model, "language_model", self.text_encoder.model)
        handle = text_model.norm.register_forward_hook(lambda module, args, output: captured.append(args[0]))
        try:
            self.text_encoder(input_ids=input_ids, **inputs)
        finally:
            handle.remove()
        slots_mask = input_ids[0, self.drop_tokens :] == self.image_token_id
        if int(slots_mask.sum()) != sum(h * w // 4 for _, h, w in latents):
            raise OmniClientError(
                "image: the text encoder's image processor resized a condition image (its "
                "max_pixels is below the condition size); its vision slots do not match the "
                "image's latent tokens",
                param="image",
            )
        hidden = captured[0][:, self.drop_tokens :].to(self.dtype)
        return self.transformer.prefix_kv(hidden, slots_mask if vision else None, latents)
