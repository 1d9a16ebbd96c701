"""Request-batch scheduling policy (no threads here; the engine's scheduler thread drives it).

FIFO by arrival: the oldest waiting request picks the key of the next batch, which takes every compatible
waiting request up to `max_num_seqs`. A batch that is not full waits until its oldest request has waited
`request_batch_max_wait_ms`, so a lone request is never delayed longer than that.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.interface import RequestBatchSamplingParamsKey, build_request_batch_sampling_params_key


@dataclass
class _Waiting:
    request: OmniDiffusionRequest
    key: RequestBatchSamplingParamsKey
    arrival: float


class RequestScheduler:
    def __init__(self, max_num_seqs: int = 1, request_batch_max_wait_ms: float = 0.0) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.max_wait_s = max(request_batch_max_wait_ms, 0.0) / 1000.0
        self._waiting: OrderedDict[str, _Waiting] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add_request(self, request: OmniDiffusionRequest, now: float | None = None) -> str:
        if request.request_id in self._waiting:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        key = build_request_batch_sampling_params_key(request)
        self._waiting[request.request_id] = _Waiting(request, key, time.monotonic() if now is None else now)
        return request.request_id

    def abort(self, request_ids: list[str]) -> list[OmniDiffusionRequest]:
        """Drop waiting requests; returns the ones that were still waiting."""
        return [self._waiting.pop(rid).request for rid in request_ids if rid in self._waiting]

    def drain(self) -> list[OmniDiffusionRequest]:
        requests = [w.request for w in self._waiting.values()]
        self._waiting.clear()
        return requests

    def schedule(self, now: float | None = None, fits: Callable[[list[OmniDiffusionRequest]], bool] | None = None
                 ) -> tuple[list[OmniDiffusionRequest], float | None]:
        """Pop the next batch, or return ([], seconds to wait before the pending batch is due). `fits` (memory
        admission) trims the batch to what fits; when not even the oldest request fits, nothing is popped and
        the caller waits for running requests to finish (the oldest keeps its place: no starvation)."""
        if not self._waiting:
            return [], None
        now = time.monotonic() if now is None else now
        head = next(iter(self._waiting.values()))
        batch = [w for w in self._waiting.values() if w.key == head.key][: self.max_num_seqs]
        due = head.arrival + self.max_wait_s
        if len(batch) < self.max_num_seqs and now < due:
            return [], due - now
        while batch and fits is not None and not fits([w.request for w in batch]):
            batch.pop()
        for w in batch:
            del self._waiting[w.request.request_id]
        return [w.request for w in batch], None
