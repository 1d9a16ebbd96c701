"""Builds the components of a Qwen-Image(-Edit) checkpoint: reference encoders/VAE, our transformer."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.model_loader.components import load_native_transformer
from vllm_omni.diffusion.model_loader.dummy import load_pretrained
from vllm_omni.models.qwen_image.transformer import QwenImageTransformer2DModel


def load_qwen_image_transformer(od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device,
                                dtype: torch.dtype) -> QwenImageTransformer2DModel:
    """Our MMDiT with the checkpoint's weights streamed in by name (every parameter must be filled), or dummy."""
    return load_native_transformer(QwenImageTransformer2DModel, model_dir, "transformer", od_config, device, dtype)


def load_qwen_image_components(od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device,
                               dtype: torch.dtype, *, with_processor: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
    components: dict[str, Any] = dict(
        tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
        text_encoder=load(Qwen2_5_VLForConditionalGeneration, model_dir / "text_encoder"),
        transformer=load_qwen_image_transformer(od_config, model_dir, device, dtype),
        vae=load(AutoencoderKLQwenImage, model_dir / "vae"),
        scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
    )
    if with_processor:
        # The image half of Qwen2VLProcessor (the full processor needs torchvision for its video half).
        from transformers import AutoImageProcessor

        components["vl_image_processor"] = AutoImageProcessor.from_pretrained(model_dir / "processor")
        components["tokenizer"] = AutoTokenizer.from_pretrained(model_dir / "processor")
    return components
