"""Where a model's checkpoint lives on disk, and which diffusers pipeline name it is served as.

`tiny/<name>` builds the built-in tiny checkpoint, a local directory is used as is, anything else is a Hugging
Face hub snapshot. Which of our classes serves the pipeline name is the model registry's business
(`vllm_omni/models/registry.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig


def resolve_model_dir(model: str, revision: str | None = None, with_weights: bool = True) -> Path:
    """`tiny/<name>` -> built tiny checkpoint; local dir as is; anything else -> Hugging Face hub snapshot
    (configs and tokenizers only when `with_weights` is False)."""
    from vllm_omni.models.tiny import TINY_PREFIX, resolve_model

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


def _offline_flag() -> str:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "0")
