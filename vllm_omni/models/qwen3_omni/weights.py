"""Reads the slices of a Qwen3-Omni checkpoint that one stage needs (talker.*, code2wav.*, ...)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch


def iter_prefixed_weights(model_dir: Path, prefixes: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every checkpoint tensor whose name starts with one of `prefixes`.

    The weight index, when present, is the authoritative shard list; only shards holding a wanted tensor
    are opened.
    """
    from safetensors import safe_open

    index_file = model_dir / "model.safetensors.index.json"
    if index_file.exists():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        shards = sorted({shard for name, shard in weight_map.items() if name.startswith(prefixes)})
    else:
        shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir}: no safetensors shard holds weights under {prefixes}")
    for shard in shards:
        with safe_open(model_dir / shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.startswith(prefixes):
                    yield name, f.get_tensor(name)


def load_into(module: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]], strip: str) -> set[str]:
    """Copy `weights` (names minus `strip`) into `module`'s parameters; every parameter must be covered."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            key = name.removeprefix(strip)
            if key not in params:
                continue
            if params[key].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[key].shape)}")
            params[key].copy_(tensor.to(params[key].dtype))
            loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s) under {strip!r}: {missing[:5]}")
    return loaded


_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint tensors (`experts.{e}.{gate,up,down}_proj.weight`, the real repo's layout) ->
    transformers' stacked `experts.gate_up_proj` (E, 2I, H) and `experts.down_proj` (E, H, I)."""
    pending: dict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m is None:
            yield name, tensor
        else:
            pending[m["prefix"]][(m["proj"], int(m["expert"]))] = tensor
    for prefix, parts in pending.items():
        num = 1 + max(e for _, e in parts)
        yield f"{prefix}.gate_up_proj", torch.stack(
            [torch.cat((parts[("gate_proj", e)], parts[("up_proj", e)])) for e in range(num)])
        yield f"{prefix}.down_proj", torch.stack([parts[("down_proj", e)] for e in range(num)])
