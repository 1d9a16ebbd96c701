"""A tiny random LoRA for a checkpoint, written in the layout diffusers and PEFT publish
(`transformer.<module>.lora_A.weight` (rank, in) and `.lora_B.weight` (out, rank) in one safetensors file, with
the `lora_adapter_metadata` PEFT config diffusers saves), for tests, the example and benchmarks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK_PROJECTIONS = re.compile(
    r"^(transformer_blocks|single_transformer_blocks|blocks)\.\d+\..*"
    r"(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|proj_mlp|proj_out|net\.0\.proj|net\.2)$"
)
"""Attention and MLP projections of the transformer blocks: what published DiT LoRAs train."""


def write_tiny_lora(
    model_dir: str | Path,
    path: str | Path,
    *,
    component: str = "transformer",
    prefix: str | None = None,
    targets: re.Pattern[str] = BLOCK_PROJECTIONS,
    **kwargs,
) -> Path:
    """A random LoRA (`write_lora`) on every linear of the checkpoint's `model_dir/<component>` whose module name
    `targets` matches; its keys start with `prefix` (default: the component, diffusers' layout)."""
    shapes: dict[str, tuple[int, int]] = {}
    for file in sorted((Path(model_dir) / component).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = tuple(f.get_slice(name).get_shape())
                if name.endswith(".weight") and len(shape) == 2:
                    shapes[name.removesuffix(".weight")] = shape
    modules = {m: shape for m, shape in shapes.items() if targets.search(m)}
    if not modules:
        raise ValueError(f"no module of {model_dir}/{component} matches {targets.pattern}")
    return write_lora(modules, path, component=prefix or component, **kwargs)


def write_lora(
    modules: dict[str, tuple[int, int]],
    path: str | Path,
    *,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
    std: float = 0.5,
    component: str = "transformer",
    alpha_tensors: bool = False,
) -> Path:
    """A random rank-`rank` LoRA on `modules` (diffusers module name -> (out, in) features); `alpha` None saves no
    config (diffusers then scales by 1), else it goes in the PEFT config diffusers saves, or with `alpha_tensors`
    into a `<module>.alpha` tensor per module (older diffusers FLUX files). Returns `path`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_features, in_features) in sorted(modules.items()):
        tensors[f"{component}.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
        tensors[f"{component}.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
        if alpha is not None and alpha_tensors:
            tensors[f"{component}.{module}.alpha"] = torch.tensor(float(alpha))
    metadata = {"format": "pt"}
    if alpha is not None and not alpha_tensors:
        config = {"r": rank, "lora_alpha": alpha, "target_modules": sorted(modules)}
        metadata["lora_adapter_metadata"] = json.dumps({f"{component}.{k}": v for k, v in config.items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return Path(path)
