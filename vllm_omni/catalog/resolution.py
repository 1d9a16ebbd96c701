"""Where a model's checkpoint lives on disk, and which diffusers pipeline name it is served as.

`tiny/<name>` builds the built-in tiny checkpoint, a local directory is used as is, anything else is a Hugging
Face hub snapshot. Which of our classes serves the pipeline name is the model registry's business
(`vllm_omni/catalog/registry.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

HUB_PROBE_TIMEOUT_S = 5.0
"""One look at the hub before a first download: huggingface_hub itself retries an unreachable hub for ~25 s
per file before it gives up."""


def resolve_model_dir(model: str, revision: str | None = None, with_weights: bool = True) -> Path:
    """`tiny/<name>` -> built tiny checkpoint; local dir as is; anything else -> Hugging Face hub snapshot
    (configs and tokenizers only when `with_weights` is False)."""
    from vllm_omni.catalog.tiny import TINY_PREFIX, resolve_model

    if model.startswith(TINY_PREFIX) and not Path(model).exists():
        return Path(resolve_model(model))
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model {model!r} is not a checkpoint directory")
    from huggingface_hub.errors import LocalEntryNotFoundError


    try:
        return download_diffusers_checkpoint(model, revision, with_weights)
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(_not_cached(model, "the hub cannot be reached")) from exc


def fetch_hub_file(model: str, filename: str, revision: str | None = None) -> Path | None:
    """`filename` of hub repo `model` (downloaded or cached), None when the repo has no such file.

    A file never fetched before is looked up once on the hub first, so that no network (or HF_HUB_OFFLINE)
    fails within seconds with a FileNotFoundError saying so instead of after huggingface_hub's retries.
    """
    from huggingface_hub import _CACHED_NO_EXIST, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    cached = try_to_load_from_cache(model, filename, revision=revision)
    if cached is _CACHED_NO_EXIST:
        return None
    if cached is None and not _hub_has_file(model, filename, revision):
        return None
    try:
        return Path(hf_hub_download(model, filename, revision=revision))
    except RemoteEntryNotFoundError:
        return None
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(_not_cached(model, "the hub cannot be reached")) from exc


def _hub_has_file(model: str, filename: str, revision: str | None) -> bool:
    """One HEAD request without retries; FileNotFoundError when offline, unreachable or no such repo."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

    if _offline():
        raise FileNotFoundError(_not_cached(model, "HF_HUB_OFFLINE is set"))
    try:
        get_hf_file_metadata(hf_hub_url(model, filename, revision=revision), timeout=HUB_PROBE_TIMEOUT_S)
    except RemoteEntryNotFoundError:
        return False
    except RepositoryNotFoundError as exc:
        raise FileNotFoundError(f"model {model!r} is neither a local directory nor a Hugging Face repo you can "
                                "access (a private or gated repo needs `hf auth login`)") from exc
    except HfHubHTTPError:
        raise
    except Exception as exc:  # the transport's own errors (DNS, refused, timeout)
        raise FileNotFoundError(_not_cached(model, f"the hub cannot be reached ({exc})")) from exc
    return True


def _not_cached(model: str, why: str) -> str:
    return (f"model {model!r} is neither a local directory nor in the Hugging Face cache, and {why}: "
            f"download it first (`hf download {model}`) or pass a local path")


def read_model_index(model_dir: Path) -> dict:
    index = model_dir / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{model_dir} has no model_index.json; is it a diffusers pipeline checkpoint?")
    return json.loads(index.read_text())


class ServedAs(Protocol):
    """What names the pipeline a stage serves (an `OmniDiffusionConfig`; read here without the runtime)."""

    model_class_name: str | None


def resolve_pipeline_class_name(od_config: ServedAs, model_dir: Path) -> str:
    """The diffusers pipeline name this model is served as (`model_class_name` overrides the index)."""
    if od_config.model_class_name:
        return od_config.model_class_name
    name = read_model_index(model_dir).get("_class_name")
    if not name:
        raise ValueError(f"{model_dir / 'model_index.json'} has no _class_name")
    return name


def _offline() -> bool:
    """huggingface_hub reads HF_HUB_OFFLINE once at import; a later setting counts too."""
    import os

    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


DIFFUSION_MODEL_WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
TRANSFORMER_WEIGHTS_INDEX = "model.safetensors.index.json"
INDEX_FILES = (DIFFUSION_MODEL_WEIGHTS_INDEX, TRANSFORMER_WEIGHTS_INDEX)


WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.msgpack", "*.h5", "*.onnx",
                        "*.onnx_data")


def download_diffusers_checkpoint(repo_id: str, revision: str | None = None, with_weights: bool = True) -> Path:
    """Fetch a diffusers repo from the hub (or the local cache when offline) without stale shards.

    First everything but weights (configs, indexes, tokenizers), then, per component, only the shards its
    index lists, or every safetensors file of an unindexed component (validated when loaded). A repo
    without model_index.json is fetched whole. `with_weights=False` stops after the first step
    (`load_format="dummy"`).
    """
    from huggingface_hub import snapshot_download

    root = Path(snapshot_download(repo_id, revision=revision, ignore_patterns=list(WEIGHT_FILE_PATTERNS)))
    if not with_weights:
        return root
    if not (root / "model_index.json").is_file():
        return Path(snapshot_download(repo_id, revision=revision))
    components = [k for k, v in json.loads((root / "model_index.json").read_text()).items()
                  if not k.startswith("_") and isinstance(v, list)]
    patterns = []
    for sub in components:
        indexed = resolve_weight_index(root / sub)
        patterns += [f"{sub}/*.safetensors"] if indexed is None else [f"{sub}/{name}" for name in indexed]
    if patterns:
        snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    return root


def resolve_weight_index(folder: Path) -> list[str] | None:
    """Shard file names listed by the folder's index, or None when there is no index."""
    indexes = [folder / name for name in INDEX_FILES if (folder / name).is_file()]
    if not indexes:
        return None
    if len(indexes) > 1:
        raise ValueError(f"Multiple index files found in {folder}: {[p.name for p in indexes]}")
    try:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"invalid weight index {indexes[0]}: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"weight index {indexes[0]} has an empty or invalid weight_map")
    return sorted(set(weight_map.values()))
