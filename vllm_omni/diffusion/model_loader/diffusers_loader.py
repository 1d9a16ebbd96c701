"""Finds and streams the weights of one component of a diffusers-format checkpoint.

A diffusers repo keeps each component in a subfolder (`transformer/`, `text_encoder/`, `vae/`). When the
subfolder has a weight index, the index is the authoritative shard list: stale shards of an older export
left next to it are ignored, and a shard the index names but the folder lacks is an error. Without an index,
every safetensors file is loaded, unless they form shard families with conflicting totals (leftovers of two
different exports), which is rejected rather than silently mixed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

DIFFUSION_MODEL_WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
TRANSFORMER_WEIGHTS_INDEX = "model.safetensors.index.json"
INDEX_FILES = (DIFFUSION_MODEL_WEIGHTS_INDEX, TRANSFORMER_WEIGHTS_INDEX)
SHARDED_SAFETENSORS_PATTERN = re.compile(r"^(?P<family>.+)-\d+-of-(?P<count>\d+)\.safetensors$")
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
        indexed = _resolve_weight_index(root / sub)
        patterns += [f"{sub}/*.safetensors"] if indexed is None else [f"{sub}/{name}" for name in indexed]
    if patterns:
        snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    return root


def _natural_sort_key(path: Path) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _resolve_weight_index(folder: Path) -> list[str] | None:
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


def _validate_unindexed_safetensors_layout(weight_files: list[Path]) -> None:
    """Reject shard families whose `-of-N` totals disagree (two exports mixed in one folder)."""
    totals: dict[str, set[int]] = {}
    for path in weight_files:
        match = SHARDED_SAFETENSORS_PATTERN.match(path.name)
        if match:
            totals.setdefault(match["family"], set()).add(int(match["count"]))
    for family, counts in totals.items():
        if len(counts) > 1:
            raise ValueError(
                f"conflicting shard totals for unindexed weights {family!r} in {weight_files[0].parent}: "
                f"{sorted(counts)}; add a weight index or remove the stale shards"
            )


def component_weight_files(model_dir: Path, subfolder: str) -> list[Path]:
    """The safetensors files that make up `model_dir/subfolder`, in load order."""
    folder = Path(model_dir) / subfolder
    if not folder.is_dir():
        raise FileNotFoundError(f"component folder {folder} does not exist")
    indexed = _resolve_weight_index(folder)
    if indexed is not None:
        files = [folder / name for name in indexed]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"weight index of {folder} names missing shard(s): {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"), key=_natural_sort_key)
    if not files:
        raise RuntimeError(f"Cannot find any model weights in {folder}")
    _validate_unindexed_safetensors_layout(files)
    return files


def iter_component_weights(
    model_dir: Path, subfolder: str, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every weight of a component, cast to `dtype` when given (floats only)."""
    from safetensors import safe_open

    for path in component_weight_files(model_dir, subfolder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield name, tensor


def read_component_config(model_dir: Path, subfolder: str, filename: str = "config.json") -> dict:
    path = Path(model_dir) / subfolder / filename
    if not path.is_file():
        raise FileNotFoundError(f"missing component config {path}")
    return json.loads(path.read_text())
