"""Which pipeline class serves a diffusers checkpoint, and where that checkpoint lives on disk.

The pipeline class comes from `_class_name` in the checkpoint's `model_index.json`. Native pipelines are
registered as lazy "module:Class" strings so that resolving a model never imports torch-heavy modules it
does not use; every other diffusers pipeline runs through the generic `DiffusersAdapterPipeline`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

OutputModality = Literal["image", "video", "audio"]

_DIFFUSION_MODELS: dict[str, tuple[str, OutputModality]] = {
    "QwenImagePipeline": ("vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image:QwenImagePipeline", "image"),
    "QwenImageEditPipeline": (
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit:QwenImageEditPipeline",
        "image",
    ),
    "FluxPipeline": ("vllm_omni.diffusion.models.flux.pipeline_flux:FluxPipeline", "image"),
    "WanPipeline": ("vllm_omni.diffusion.models.wan.pipeline_wan:WanPipeline", "video"),
    "WanImageToVideoPipeline": ("vllm_omni.diffusion.models.wan.pipeline_wan_i2v:WanImageToVideoPipeline", "video"),
}
"""diffusers `_class_name` -> (our pipeline as "module:Class", what it outputs)."""

DIFFUSERS_ADAPTER = "vllm_omni.diffusion.models.diffusers_adapter.pipeline_diffusers_adapter:DiffusersAdapterPipeline"

# Substrings of diffusers class names whose pipelines return frames or waveforms instead of images.
_VIDEO_HINTS = ("Video", "Wan", "I2V", "T2V", "LTX", "Mochi", "Hunyuan", "Cog", "Allegro", "Latte", "AnimateDiff")
_AUDIO_HINTS = ("Audio", "Music")


def resolve_model_dir(model: str, revision: str | None = None, with_weights: bool = True) -> Path:
    """`tiny/<name>` -> built tiny checkpoint; local dir as is; anything else -> Hugging Face hub snapshot
    (configs and tokenizers only when `with_weights` is False)."""
    from vllm_omni.testing.tiny_models import TINY_PREFIX, resolve_model

    if model.startswith(TINY_PREFIX) and not Path(model).exists():
        return Path(resolve_model(model))
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model {model!r} is not a checkpoint directory")
    from huggingface_hub.errors import LocalEntryNotFoundError

    from vllm_omni.diffusion.model_loader.diffusers_loader import download_diffusers_checkpoint

    try:
        return download_diffusers_checkpoint(model, revision, with_weights)
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor in the Hugging Face cache, and the hub cannot be "
            f"reached (HF_HUB_OFFLINE={_offline_flag()}); download it first or pass a local path"
        ) from exc


def read_model_index(model_dir: Path) -> dict:
    index = model_dir / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{model_dir} has no model_index.json; is it a diffusers pipeline checkpoint?")
    return json.loads(index.read_text())


def resolve_pipeline_class_name(od_config: OmniDiffusionConfig, model_dir: Path) -> str:
    """The diffusers pipeline name this model is served as (`model_class_name` overrides the index)."""
    if od_config.model_class_name:
        return od_config.model_class_name
    name = read_model_index(model_dir).get("_class_name")
    if not name:
        raise ValueError(f"{model_dir / 'model_index.json'} has no _class_name")
    return name


def pipeline_class_path(class_name: str, use_diffusers_adapter: bool = False) -> str:
    """A "module:Class" name (a custom pipeline) is used as is."""
    if ":" in class_name and not use_diffusers_adapter:
        return class_name
    if use_diffusers_adapter or class_name not in _DIFFUSION_MODELS:
        return DIFFUSERS_ADAPTER
    return _DIFFUSION_MODELS[class_name][0]


def load_pipeline_class(class_name: str, use_diffusers_adapter: bool = False) -> type:
    module_name, _, attr = pipeline_class_path(class_name, use_diffusers_adapter).partition(":")
    return getattr(importlib.import_module(module_name), attr)


def output_modality(class_name: str) -> OutputModality:
    if class_name in _DIFFUSION_MODELS:
        return _DIFFUSION_MODELS[class_name][1]
    if ":" in class_name:
        return getattr(load_pipeline_class(class_name), "output_modality", "image")
    if any(hint in class_name for hint in _AUDIO_HINTS):
        return "audio"
    if any(hint in class_name for hint in _VIDEO_HINTS):
        return "video"
    return "image"


def _offline_flag() -> str:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "0")
