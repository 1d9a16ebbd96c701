"""Regional torch.compile: compile each repeated transformer block once, reuse it for every layer.

Compiling the block class (not the whole model) keeps compile time at one block's worth while Inductor fuses
the elementwise work around the GEMMs (adaLN modulation, gating, RoPE, GELU, q/k RMSNorm) into few kernels.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def compile_repeated_blocks(model: nn.Module, **compile_kwargs: Any) -> int:
    """`torch.compile` every submodule whose class is listed in `model._repeated_blocks`; returns how many."""
    names = set(getattr(model, "_repeated_blocks", ()))
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _repeated_blocks to compile")
    options = {"fullgraph": True, "dynamic": False, **compile_kwargs}
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            module.compile(**options)
            count += 1
    return count
