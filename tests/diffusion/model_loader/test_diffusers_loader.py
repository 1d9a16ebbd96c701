"""Pins the loader's shard selection: the index is authoritative, mixed unindexed exports are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_omni.diffusion.model_loader.diffusers_loader import (
    component_weight_files,
    iter_component_weights,
)


def _shard(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name))


def _index(folder: Path, weight_map: dict[str, str], name="diffusion_pytorch_model.safetensors.index.json"):
    (folder / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_is_authoritative_and_stale_shards_ignored(tmp_path: Path):
    sub = tmp_path / "transformer"
    _shard(sub, "diffusion_pytorch_model-00001-of-00002.safetensors", {"a": torch.ones(2)})
    _shard(sub, "diffusion_pytorch_model-00002-of-00002.safetensors", {"b": torch.zeros(3)})
    # Leftovers of an older 3-shard export next to the current one.
    _shard(sub, "diffusion_pytorch_model-00001-of-00003.safetensors", {"stale": torch.ones(1)})
    _index(sub, {"a": "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "b": "diffusion_pytorch_model-00002-of-00002.safetensors"})
    files = component_weight_files(tmp_path, "transformer")
    assert [f.name for f in files] == [
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
    ]
    names = dict(iter_component_weights(tmp_path, "transformer"))
    assert sorted(names) == ["a", "b"]


def test_text_encoder_index_name(tmp_path: Path):
    sub = tmp_path / "text_encoder"
    _shard(sub, "model-00001-of-00001.safetensors", {"w": torch.ones(2)})
    _index(sub, {"w": "model-00001-of-00001.safetensors"}, name="model.safetensors.index.json")
    assert [f.name for f in component_weight_files(tmp_path, "text_encoder")] == ["model-00001-of-00001.safetensors"]


def test_conflicting_unindexed_shard_totals_rejected(tmp_path: Path):
    sub = tmp_path / "transformer"
    _shard(sub, "diffusion_pytorch_model-00001-of-00004.safetensors", {"a": torch.ones(1)})
    _shard(sub, "diffusion_pytorch_model-00001-of-00008.safetensors", {"a": torch.ones(1)})
    with pytest.raises(ValueError, match="conflicting shard totals") as info:
        component_weight_files(tmp_path, "transformer")
    assert "diffusion_pytorch_model" in str(info.value) and "[4, 8]" in str(info.value)


def test_unindexed_consistent_family_loads_in_natural_order(tmp_path: Path):
    sub = tmp_path / "vae"
    for i in (10, 2, 1):
        _shard(sub, f"w-{i:d}-of-00010.safetensors", {f"t{i}": torch.ones(1)})
    assert [f.name for f in component_weight_files(tmp_path, "vae")] == [
        "w-1-of-00010.safetensors", "w-2-of-00010.safetensors", "w-10-of-00010.safetensors"]


def test_missing_indexed_shard_names_the_file(tmp_path: Path):
    sub = tmp_path / "transformer"
    _shard(sub, "diffusion_pytorch_model-00001-of-00002.safetensors", {"a": torch.ones(1)})
    _index(sub, {"a": "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "b": "diffusion_pytorch_model-00002-of-00002.safetensors"})
    with pytest.raises(FileNotFoundError, match="diffusion_pytorch_model-00002-of-00002.safetensors"):
        component_weight_files(tmp_path, "transformer")


def test_invalid_or_multiple_indexes_and_no_weights(tmp_path: Path):
    sub = tmp_path / "transformer"
    _shard(sub, "x.safetensors", {"a": torch.ones(1)})
    _index(sub, {})
    with pytest.raises(ValueError, match="empty or invalid weight_map"):
        component_weight_files(tmp_path, "transformer")
    _index(sub, {"a": "x.safetensors"}, name="model.safetensors.index.json")
    with pytest.raises(ValueError, match="Multiple index files"):
        component_weight_files(tmp_path, "transformer")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="Cannot find any model weights"):
        component_weight_files(tmp_path, "empty")
    with pytest.raises(FileNotFoundError, match="nope"):
        component_weight_files(tmp_path, "nope")


def test_dtype_control_casts_floats_only(tmp_path: Path):
    _shard(tmp_path / "c", "m.safetensors", {"f": torch.ones(2), "i": torch.arange(3)})
    weights = dict(iter_component_weights(tmp_path, "c", dtype=torch.bfloat16))
    assert weights["f"].dtype == torch.bfloat16 and weights["i"].dtype == torch.int64


def test_hub_download_fetches_only_indexed_shards(tmp_path: Path, monkeypatch):
    """The hub is stood in for by a local folder (no network here); pins which files are asked for."""
    import fnmatch
    import shutil

    import huggingface_hub

    from vllm_omni.catalog.resolution import WEIGHT_FILE_PATTERNS, download_diffusers_checkpoint

    remote, local = tmp_path / "remote", tmp_path / "snapshot"
    (remote / "transformer").mkdir(parents=True)
    (remote / "model_index.json").write_text(json.dumps({"_class_name": "P", "transformer": ["diffusers", "T"],
                                                         "vae": ["diffusers", "V"], "scheduler": ["diffusers", "S"]}))
    _shard(remote / "transformer", "diffusion_pytorch_model-00001-of-00001.safetensors", {"a": torch.ones(1)})
    _shard(remote / "transformer", "diffusion_pytorch_model-00001-of-00003.safetensors", {"old": torch.ones(1)})
    _index(remote / "transformer", {"a": "diffusion_pytorch_model-00001-of-00001.safetensors"})
    _shard(remote / "vae", "diffusion_pytorch_model.safetensors", {"v": torch.ones(1)})
    (remote / "scheduler").mkdir()
    (remote / "scheduler" / "scheduler_config.json").write_text("{}")
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None):
        calls.append((allow_patterns, ignore_patterns))
        for path in remote.rglob("*"):
            rel = str(path.relative_to(remote))
            if path.is_dir() or (allow_patterns and not any(fnmatch.fnmatch(rel, p) for p in allow_patterns)):
                continue
            if ignore_patterns and any(fnmatch.fnmatch(path.name, p) for p in ignore_patterns):
                continue
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, local / rel)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    root = download_diffusers_checkpoint("org/model")
    assert root == local
    assert calls[0] == (None, list(WEIGHT_FILE_PATTERNS))  # configs, indexes, tokenizers first
    assert sorted(calls[1][0]) == ["scheduler/*.safetensors",
                                   "transformer/diffusion_pytorch_model-00001-of-00001.safetensors",
                                   "vae/*.safetensors"]
    assert not (local / "transformer" / "diffusion_pytorch_model-00001-of-00003.safetensors").exists()
    assert dict(iter_component_weights(root, "transformer")).keys() == {"a"}
    assert dict(iter_component_weights(root, "vae")).keys() == {"v"}
