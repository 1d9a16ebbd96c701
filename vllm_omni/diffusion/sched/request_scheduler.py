"""Request-batch scheduling policy (no threads here; the engine's scheduler thread drives it).

The most urgent waiting request picks the key of the next batch, which takes the most urgent compatible waiting
requests up to `max_num_seqs`. Urgency is the `--diffusion-scheduler-policy`: arrival (fcfs), `priority` then
arrival (priority), or deadline (slo: arrival + `deadline_ms`, else the default deadline). A batch that is not
full waits until its head has waited `request_batch_max_wait_ms`, so a lone request is never delayed longer than
that. Whole requests run to the end: nothing is preempted in request mode.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.interface import RequestBatchSamplingParamsKey, build_request_batch_sampling_params_key
from vllm_omni.diffusion.sched.step_policy import POLICIES, Policy


@dataclass
class _Waiting:
    request: OmniDiffusionRequest
    key: RequestBatchSamplingParamsKey
    arrival: float


class RequestScheduler:
    def __init__(self, max_num_seqs: int = 1, request_batch_max_wait_ms: float = 0.0, policy: Policy = "fcfs",
                 default_deadline_ms: float = 60000.0) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if policy not in POLICIES:
            raise ValueError(f"diffusion_scheduler_policy must be one of {list(POLICIES)}, got {policy!r}")
        self.max_num_seqs = max_num_seqs
        self.max_wait_s = max(request_batch_max_wait_ms, 0.0) / 1000.0
        self.policy = policy
        self.default_deadline_s = default_deadline_ms / 1000.0
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
        ranked = sorted(self._waiting.values(), key=self._urgency)  # stable: arrival order breaks ties
        head = ranked[0]
        batch = [w for w in ranked if w.key == head.key][: self.max_num_seqs]
        due = head.arrival + self.max_wait_s
        if len(batch) < self.max_num_seqs and now < due:
            return [], due - now
        while batch and fits is not None and not fits([w.request for w in batch]):
            batch.pop()
        for w in batch:
            del self._waiting[w.request.request_id]
        return [w.request for w in batch], None

    def _urgency(self, waiting: _Waiting) -> float:
        sp = waiting.request.sampling_params
        if self.policy == "priority":
            return sp.priority
        if self.policy == "slo":
            return waiting.arrival + (sp.deadline_ms / 1000.0 if sp.deadline_ms else self.default_deadline_s)
        return 0.0
