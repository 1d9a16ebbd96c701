"""What a pipeline's forward may use besides its batch, passed to it explicitly by the model runner.

The runner builds one `StepContext` per `pipeline.forward`: the partial-output sink (`report_progress` /
`emit_partial` reach the requests' submitters while the forward still runs; no-ops when nobody listens), the
abort flag the denoise loop polls between steps (the same answer on every rank), and the current step and
normalized timestep the loop records so that step-gated layers (cache, sparse attention) can act on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

PartialSink = Callable[[str, str, dict[str, Any]], None]
"""(request_id, kind, data) -> None; must not block (it runs inside the denoise loop)."""


def _never(request_id: str) -> bool:
    return False


@dataclass
class StepContext:
    """What a pipeline's forward may use besides its batch: passed explicitly, never a module global."""

    od_config: OmniDiffusionConfig
    request_ids: list[str] = field(default_factory=list)
    partial_sink: PartialSink | None = None
    abort_requested: Callable[[str], bool] = _never
    """True once the request was aborted; the worker sets it from its abort side channel between steps."""
    abort_agreed: bool = False
    """`abort_requested` already answers the same on every rank (step mode: the round's plan), so `aborted` needs
    no broadcast of its own."""
    step_index: int | None = None
    timestep: float | None = None
    """Normalized timestep of the running step, 1.0 = pure noise down to 0.0."""

    def report_progress(self, step: int, total: int, request_ids: list[str] | None = None) -> None:
        """Denoise progress (`step` of `total` steps done) of `request_ids`, default every request."""
        if self.partial_sink is None:
            return
        for request_id in self.request_ids if request_ids is None else request_ids:
            self.partial_sink(request_id, "progress", {"step": step, "total": total})

    def emit_partial(self, request_id: str, kind: str, data: dict[str, Any]) -> None:
        """Send a partial result (e.g. kind "video_chunk" with decoded frames) of one request of this forward."""
        if self.partial_sink is not None:
            self.partial_sink(request_id, kind, data)

    @property
    def partials_enabled(self) -> bool:
        """Whether anyone listens, so pipelines can skip preparing payloads nobody will read."""
        return self.partial_sink is not None

    def aborted(self, request_ids: list[str]) -> list[str]:
        """The subset of `request_ids` aborted by now, as rank 0 sees it on every rank of a multi-rank worker.

        In request mode each rank reads the abort channel on its own, so an abort reaches the ranks at different
        steps; ranks that acted on their own view would leave a forward's collectives at different steps and hang.
        Rank 0 decides and broadcasts, at each check (every rank checks at the same points of the same loop)."""
        aborted = [request_id for request_id in request_ids if self.abort_requested(request_id)]
        return aborted if self.abort_agreed else _rank0_decides(aborted)


def _rank0_decides(value: list[str]) -> list[str]:
    from vllm.distributed.parallel_state import get_world_group, model_parallel_is_initialized

    if model_parallel_is_initialized() and get_world_group().world_size > 1:
        return get_world_group().broadcast_object(value, src=0)
    return value
