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

from vllm_omni.catalog.resolution import resolve_weight_index

SHARDED_SAFETENSORS_PATTERN = re.compile(r"^(?P<family>.+)-\d+-of-(?P<count>\d+)\.safetensors$")


def _natural_sort_key(path: Path) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


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
    indexed = resolve_weight_index(folder)
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
