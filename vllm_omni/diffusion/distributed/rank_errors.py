"""When a request fails on some ranks of a multi-rank diffusion stage and not on the others.

Every rank runs the same forward, with collectives inside. A rank that raises (OOM, a NaN guard, a decode
failure) leaves the forward while its peers go on into the next collective, so the ranks no longer run the
same collectives and their groups cannot be trusted again. The ranks therefore compare what failed where
each forward ends (request mode) and after each phase of a step round (step mode), over a gloo group of all
ranks that waits twice `distributed_timeout_seconds` (so a rank that failed is still there when a peer's
collective times out):

- the same requests failed on every rank with the same error (bad input, an error every rank hits alike):
  the ranks stayed in step; those requests fail with that error and the stage goes on;
- anything else (a request failed on some ranks only, or with different errors, or a peer never came because
  it waits in a collective that the failed rank skipped, until `distributed_timeout_seconds`): the ranks are
  out of step. `RanksDesynchronized` carries each failed request's output (the earliest failure among the
  ranks, which is the cause: a peer that waited fails later, with a timeout); every rank sends them (the
  engine takes the first), then every worker exits and the engine restarts the stage's workers (the other
  in-flight requests get its 503).
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import msgspec

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class RankFailure(msgspec.Struct, frozen=True):
    """One request's failure on one rank."""

    rank: int
    at: float
    """time.time() of the failure: the earliest one among the ranks is the cause."""
    error: str
    status_code: int | None
    error_type: str | None

    def output(self) -> DiffusionOutput:
        return DiffusionOutput(error=self.error, error_status_code=self.status_code, error_type=self.error_type)


class RanksDesynchronized(RuntimeError):
    """The ranks took different paths through a forward: the worker must exit (the engine restarts them).

    `outputs`: the output to report for each failed key; `batches`: the (batch_id, outputs) results the worker
    sends before it exits (every rank sends them, so they are on their way before the first rank is gone)."""

    def __init__(self, reason: str, outputs: dict[Hashable, DiffusionOutput]) -> None:
        super().__init__(reason)
        self.outputs = outputs
        self.batches: list[tuple[int, list[DiffusionOutput]]] = []

    def output_for(self, key: Hashable) -> DiffusionOutput:
        """The key's failure, or this error for a key that did not fail itself (its forward cannot be trusted)."""
        return self.outputs.get(key) or DiffusionOutput.from_exception(self)


def failure(output: DiffusionOutput, rank: int) -> RankFailure:
    return RankFailure(rank, time.time(), output.error or "", output.error_status_code, output.error_type)


def agree_on_failures(failed: dict[Hashable, DiffusionOutput]) -> dict[Hashable, DiffusionOutput]:
    """This rank's failed keys in, every rank's agreed failures out (the same dict on every rank); raises
    `RanksDesynchronized` when the ranks disagree or the exchange itself fails (a peer died or hangs)."""
    from vllm.distributed.parallel_state import get_world_group, model_parallel_is_initialized

    from vllm_omni.diffusion.distributed.parallel_state import get_diffusion_groups

    groups = get_diffusion_groups()
    if groups is None or not model_parallel_is_initialized() or get_world_group().world_size == 1:
        return dict(failed)
    group = get_world_group()
    mine = {key: failure(out, group.rank_in_group) for key, out in failed.items()}
    views: list[dict[Hashable, RankFailure] | None] = [None] * group.world_size
    try:
        import torch.distributed as dist

        dist.all_gather_object(views, mine, group=groups.failures)
    except Exception as exc:
        reason = f"diffusion rank {group.rank_in_group} could not compare failures with its peers: {exc}"
        logger.error(reason)
        raise RanksDesynchronized(reason, dict(failed)) from exc
    keys = {key for view in views for key in view}
    agreed, split = {}, []
    for key in keys:
        seen = [view.get(key) for view in views]
        first = min((f for f in seen if f is not None), key=lambda f: f.at)
        agreed[key] = first.output()
        if any(f is None or (f.error, f.error_type) != (first.error, first.error_type) for f in seen):
            split.append(f"{key}: {[None if f is None else f'{f.error_type}: {f.error}' for f in seen]}")
    if split:
        reason = "the diffusion ranks failed differently (by rank): " + "; ".join(split)
        logger.error(reason)
        raise RanksDesynchronized(reason, agreed)
    return agreed
