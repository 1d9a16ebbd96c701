"""Per-forward state a pipeline's layers may read without threading it through every call.

The model runner opens one context per `pipeline.forward`; the pipeline's denoise loop records the current
step and normalized timestep so that step-gated layers (cache, sparse attention) can act on them. It also
carries the partial-output sink: `report_progress` / `emit_partial` reach the requests' submitters while the
forward still runs (no-ops when nobody listens, e.g. a pipeline used on its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig


def _never(request_id: str) -> bool:
    return False


@dataclass
class ForwardContext:
    od_config: OmniDiffusionConfig
    batch_size: int = 0
    denoise_step_idx: int | None = None
    denoise_timestep: float | None = None
    """Normalized timestep, 1.0 at pure noise down to 0.0."""
    extra: dict[str, Any] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)
    partial_sink: PartialSink | None = None
    abort_requested: Callable[[str], bool] = _never
    """True once the request was aborted; the worker sets it from its abort side channel between steps."""

    def aborted(self, request_ids: list[str]) -> list[str]:
        """The subset of `request_ids` aborted now (pipelines check it before every denoise step)."""
        return [rid for rid in request_ids if self.abort_requested(rid)]


PartialSink = Callable[[str, str, dict[str, Any]], None]
"""(request_id, kind, data) -> None; must not block (it runs inside the denoise loop)."""

_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(od_config: OmniDiffusionConfig, batch_size: int = 0, request_ids: list[str] | None = None,
                        partial_sink: PartialSink | None = None,
                        abort_requested: Callable[[str], bool] | None = None) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(od_config=od_config, batch_size=batch_size,
                                      request_ids=list(request_ids or []), partial_sink=partial_sink,
                                      abort_requested=abort_requested or _never)
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


def report_progress(step: int, total: int) -> None:
    """Denoise progress of every request in the running forward (`step` of `total` steps done)."""
    ctx = _forward_context
    if ctx is not None and ctx.partial_sink is not None:
        for request_id in ctx.request_ids:
            ctx.partial_sink(request_id, "progress", {"step": step, "total": total})


def emit_partial(request_id: str, kind: str, data: dict[str, Any]) -> None:
    """Send a partial result (e.g. kind "video_chunk" with decoded frames) of one request of this forward."""
    ctx = _forward_context
    if ctx is not None and ctx.partial_sink is not None:
        ctx.partial_sink(request_id, kind, data)


def partials_enabled() -> bool:
    """Whether anyone listens, so pipelines can skip preparing payloads nobody will read."""
    ctx = _forward_context
    return ctx is not None and ctx.partial_sink is not None
