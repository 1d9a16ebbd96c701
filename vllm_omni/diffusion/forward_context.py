"""Per-forward state a pipeline's layers may read without threading it through every call.

The model runner opens one context per `pipeline.forward`; the pipeline's denoise loop records the current
step and normalized timestep so that step-gated layers (cache, sparse attention) can act on them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig


@dataclass
class ForwardContext:
    od_config: OmniDiffusionConfig
    batch_size: int = 0
    denoise_step_idx: int | None = None
    denoise_timestep: float | None = None
    """Normalized timestep, 1.0 at pure noise down to 0.0."""
    extra: dict[str, Any] = field(default_factory=dict)


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(od_config: OmniDiffusionConfig, batch_size: int = 0) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(od_config=od_config, batch_size=batch_size)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext | None:
    """The context of the running forward, or None outside one (e.g. a pipeline used on its own)."""
    return _forward_context


def set_forward_context_denoise_step_idx(step_idx: int | None) -> None:
    if _forward_context is not None:
        _forward_context.denoise_step_idx = step_idx


def set_forward_context_denoise_timestep(timestep: float | None) -> None:
    if _forward_context is not None:
        _forward_context.denoise_timestep = None if timestep is None else float(timestep)
