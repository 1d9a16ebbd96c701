"""The diffusion stage's one scheduler, for both execution modes: one place decides, every worker rank executes
(vLLM's Scheduler beside EngineCore).

Each round `schedule` returns a `StepPlan`; rank 0's `StepResult` comes back to `update`. The scheduler holds no
tensors, only what its policy (`policy.py`: fcfs / priority / slo, the cost model, deadlines) reads of each request:

    abort    requests aborted on the workers leave at the start of the next round (their states are freed)
    admit    step mode: the policy picks the requests (at most `max_num_seqs`) that step next: waiting ones join
             (memory admission: only while `fits`), paused ones resume, and a resident one left out is paused
             (the ranks keep its latents; no recompute), at most `max_paused_states` at a time.
             request mode: the policy that never preempts: once the last batch left, the most urgent waiting
             request picks the batch key, and the most urgent compatible ones (at most `max_num_seqs`, while
             `fits`) run their whole denoise in one go; a batch that is not full waits for company until its
             head waited `request_batch_max_wait_ms` (`due`)
    update   the ranks report each state's steps, the round's forwards and the encode/decode seconds (request
             mode: each output's durations): the cost model learns from them, and the requests that left get
             their stats

Because the ranks read nothing but the plan (no clock, no socket timing, no abort channel), they stay in step with
no object broadcast between them; what fails where is still compared once per phase (`distributed/rank_errors.py`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from vllm_omni.diffusion.core.batch_key import build_request_batch_sampling_params_key
from vllm_omni.diffusion.core.policy import (
    DEFAULT_STEPS,
    AdmissionControl,
    ShapeKey,
    StepPolicy,
    shape_key,
    shape_label,
)
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.ipc import StepPlan, StepResult
from vllm_omni.diffusion.offload.distributed import dlo_wave_key
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import OmniClientError
from vllm_omni.outputs import StepStats

Fits = Callable[[list[OmniDiffusionRequest]], bool]
"""Memory admission: whether these requests may join what already runs on the workers."""


@dataclass(eq=False)
class DiffusionJob:
    """One request from `add` to its output, as the policy sees it (`Schedulable`)."""

    request: OmniDiffusionRequest
    stream: bool
    deadline_ms: float
    batch_key: Hashable
    """Request mode: only jobs of one key share a batch (`DiffusionScheduler.batch_key`)."""
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    """When a plan first sent it to the workers (prepared there from then on)."""
    steps_done: int = 0
    total_steps: int | None = None
    """Known once the workers prepared its timesteps."""
    stats: StepStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = StepStats(shape_label(shape_key(self.request)))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def deadline(self) -> float:
        return self.arrival + self.deadline_ms / 1000.0

    @property
    def prepared(self) -> bool:
        return self.admitted is not None

    @property
    def remaining_steps(self) -> int:
        total = self.total_steps or self.request.sampling_params.num_inference_steps or DEFAULT_STEPS
        return total - self.steps_done


class DiffusionScheduler:
    def __init__(self, od_config: OmniDiffusionConfig) -> None:
        self.whole_requests = not od_config.step_execution
        """Request mode: a batch runs whole requests to their end (never preempted, nothing paused)."""
        self.max_resident = (
            od_config.parallel_config.data_parallel_size
            if od_config.enable_distributed_layerwise_offload  # DLO: a batch is a wave, one request per rank
            else od_config.max_num_seqs
        )
        self.batch_key: Callable[[OmniDiffusionRequest], Hashable] = (
            dlo_wave_key if od_config.enable_distributed_layerwise_offload else build_request_batch_sampling_params_key
        )
        """What a batch's requests share: under DLO a wave's (its LoRA adapters too: the ranks cannot mix them)."""
        self.max_wait_s = max(od_config.request_batch_max_wait_ms, 0.0) / 1000.0
        self.max_paused = od_config.max_paused_states
        self.policy = StepPolicy(
            od_config.diffusion_scheduler_policy,
            starvation_factor=od_config.slo_starvation_factor,
            default_deadline_ms=od_config.default_deadline_ms,
            deadline_factor=od_config.slo_deadline_factor,
        )
        self.admission = (
            AdmissionControl(od_config.slo_admission_min_accept) if od_config.slo_admission_control else None
        )
        """slo admission control (`add` refuses what cannot make its deadline), None when off."""
        self.num_refused = 0
        self.waiting: list[DiffusionJob] = []
        """Not admitted yet, in arrival order."""
        self.paused: list[DiffusionJob] = []
        """Prepared on the workers, left out of the last round."""
        self.resident: list[DiffusionJob] = []
        """The requests that stepped in the last round, most urgent first."""
        self._leaving: dict[str, DiffusionJob] = {}
        """Aborted while on the workers: the next plan drops them, its result reports them."""
        self._rounds = itertools.count()
        self.due: float | None = None
        """Request mode: seconds until the pending batch that is not full goes anyway (after an empty plan)."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.paused or self.resident or self._leaving)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def on_workers(self) -> list[DiffusionJob]:
        return [*self.resident, *self.paused, *self._leaving.values()]

    def add(self, request: OmniDiffusionRequest, stream: bool = False, now: float | None = None) -> DiffusionJob:
        """Queue a request; with admission control, one predicted to miss its deadline behind the work ahead of
        it is refused (429 naming `deadline_ms`) unless the throughput floor keeps it."""
        if any(job.request_id == request.request_id for job in [*self.waiting, *self.on_workers()]):
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        job = DiffusionJob(request, stream, self.policy.deadline_ms(request), batch_key=self.batch_key(request))
        if now is not None:
            job.arrival = now
        if self.admission is not None:
            running = self.resident if self.whole_requests else []  # a batch in flight runs to its end
            queue = [*self.waiting, *self.paused] + ([] if self.whole_requests else self.resident)
            finish = self.admission.refuse(self.policy, queue, job, job.arrival, running)
            if finish is not None:
                self.num_refused += 1
                raise OmniClientError(
                    f"request refused by admission control: deadline_ms={job.deadline_ms:.0f} cannot be met, the "
                    f"predicted finish is {(finish - job.arrival) * 1000:.0f} ms after arrival behind "
                    f"{len(queue) + len(running)} request(s); retry later or set a longer deadline_ms",
                    status_code=429,
                    param="deadline_ms",
                )
        self.waiting.append(job)
        return job

    def abort(self, request_ids: list[str]) -> list[DiffusionJob]:
        """Drop the waiting requests at once (returned: they never reached the workers); mark the others, which
        the next plan drops."""
        wanted = set(request_ids)
        dropped = [job for job in self.waiting if job.request_id in wanted]
        self.waiting = [job for job in self.waiting if job.request_id not in wanted]
        for job in [job for job in self.resident + self.paused if job.request_id in wanted]:
            self._leaving[job.request_id] = job
        self.resident = [job for job in self.resident if job.request_id not in wanted]
        self.paused = [job for job in self.paused if job.request_id not in wanted]
        return dropped

    def drain(self) -> list[DiffusionJob]:
        """Forget every request (the engine fails them)."""
        jobs = [*self.waiting, *self.on_workers()]
        self.waiting, self.paused, self.resident, self._leaving = [], [], [], {}
        return jobs

    def forget_workers(self) -> list[DiffusionJob]:
        """The workers died: the requests they held are gone (returned), the waiting ones wait for new workers."""
        jobs = self.on_workers()
        self.paused, self.resident, self._leaving = [], [], {}
        return jobs

    def schedule(self, now: float | None = None, fits: Fits | None = None) -> StepPlan:
        """The next round: drops, then the policy's choice (newcomers only while `fits`) as the resident set."""
        now = time.perf_counter() if now is None else now
        if self.whole_requests:
            return self._schedule_batch(now, fits)
        chosen = self.policy.choose(self.resident, self.paused, self.waiting, self.max_resident, self.max_paused, now)
        new: list[DiffusionJob] = []
        for job in [job for job in chosen if not job.prepared]:
            if fits is not None and not fits([j.request for j in [*new, job]]):
                chosen.remove(job)  # it keeps its place in the queue
                continue
            new.append(job)
            job.admitted = now
        chosen_ids = {id(job) for job in chosen}
        for job in self.resident:
            if id(job) not in chosen_ids:
                job.stats.preemptions += 1
        self.paused = [job for job in self.paused + self.resident if id(job) not in chosen_ids]
        self.waiting = [job for job in self.waiting if id(job) not in chosen_ids]
        self.resident = list(chosen)
        return StepPlan(
            round_id=next(self._rounds),
            new=[job.request for job in new],
            stream=[job.request_id for job in new if job.stream],
            step=[job.request_id for job in chosen],
            abort=list(self._leaving),
        )

    def _schedule_batch(self, now: float, fits: Fits | None) -> StepPlan:
        """Request mode: the next batch of whole requests once the last one left (an empty plan meanwhile)."""
        self.due = None
        batch: list[DiffusionJob] = []
        if self.waiting and not (self.resident or self._leaving):  # never beside a batch in flight
            ranked = sorted(self.waiting, key=lambda job: self.policy.urgency(job, now))  # stable: arrival ties
            key = ranked[0].batch_key
            candidates = [job for job in ranked if job.batch_key == key][: self.max_resident]
            due = ranked[0].arrival + self.max_wait_s
            if len(candidates) < self.max_resident and now < due:
                self.due = due - now
            else:
                for job in candidates:  # the head always fits alone: `submit` refused what never could
                    if batch and fits is not None and not fits([j.request for j in [*batch, job]]):
                        break
                    batch.append(job)
        for job in batch:
            job.admitted = now
        chosen_ids = {id(job) for job in batch}
        self.waiting = [job for job in self.waiting if id(job) not in chosen_ids]
        self.resident += batch
        ids = [job.request_id for job in batch]
        return StepPlan(
            round_id=next(self._rounds),
            new=[job.request for job in batch],
            stream=[job.request_id for job in batch if job.stream],
            step=ids,
            abort=[],
        )

    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[DiffusionJob, DiffusionOutput]]:
        """Learn from the round; returns the requests that left it with their outputs (stats filled in)."""
        jobs = {job.request_id: job for job in [*self.resident, *self.paused, *self._leaving.values()]}
        self._leaving = {rid: job for rid, job in self._leaving.items() if rid not in plan.abort}
        for rid, (done, total) in result.progress.items():
            if rid in jobs:
                jobs[rid].steps_done, jobs[rid].total_steps = done, total
        if not self.whole_requests:
            self._observe(jobs, result)
        left: list[tuple[DiffusionJob, DiffusionOutput]] = []
        for rid, output in result.outputs.items():
            job = jobs.get(rid)
            if job is None:
                continue
            self.resident = [j for j in self.resident if j is not job]
            self.paused = [j for j in self.paused if j is not job]
            self._leaving.pop(rid, None)  # aborted while its last round ran: it left anyway
            left.append((job, output))
        if self.whole_requests:
            self._observe_batch(left)
        now = time.perf_counter()
        for job, output in left:
            output.stage_durations.setdefault("forward", now - job.arrival)
            if not self.whole_requests:
                output.stage_durations["step_admission_wait"] = job.admitted - job.arrival
            job.stats.deadline_missed = (
                output.error is None
                and now > job.deadline
                and (job.request.sampling_params.deadline_ms is not None or self.policy.policy == "slo")
            )
            job.stats.waiting, job.stats.running = len(self.waiting) + len(self.paused), len(self.resident)
            output.step_stats = job.stats
        return left

    def _observe_batch(self, left: list[tuple[DiffusionJob, DiffusionOutput]]) -> None:
        """Request mode: one batched forward per step of the batch's shape (its denoise seconds / steps), and
        each request's encode and decode."""
        done = [(job, out) for job, out in left if out.error is None and "denoise" in out.stage_durations]
        if not done:
            return
        steps = max(
            job.total_steps or job.request.sampling_params.num_inference_steps or DEFAULT_STEPS for job, _ in done
        )
        step_seconds = max(out.stage_durations["denoise"] for _, out in done) / steps
        self.policy.cost.observe(shape_key(done[0][0].request), step_seconds, batch=len(done))
        for job, out in done:
            job.stats.step_seconds = [step_seconds] * steps
            job.stats.step_batches = [len(done)] * steps
            key = shape_key(job.request)
            for phase, name in (("encode", "text_encoder"), ("decode", "vae_decode")):
                if name in out.stage_durations:
                    self.policy.cost.observe_phase(key, phase, out.stage_durations[name])

    def _observe(self, jobs: dict[str, DiffusionJob], result: StepResult) -> None:
        """The cost model learns what one step of the round's states of each shape cost (the seconds of their
        forwards; each state of a shared forward waited for all of it), and each shape's encode and decode."""
        states: dict[ShapeKey, int] = {}
        seconds_by_shape: dict[ShapeKey, float] = {}
        for request_ids, seconds in result.forwards:
            keys = set()
            for rid in request_ids:
                job = jobs.get(rid)
                if job is None:
                    continue
                job.stats.step_seconds.append(seconds)
                job.stats.step_batches.append(len(request_ids))
                key = shape_key(job.request)
                states[key] = states.get(key, 0) + 1
                keys.add(key)
            for key in keys:
                seconds_by_shape[key] = seconds_by_shape.get(key, 0.0) + seconds
        for key, count in states.items():
            self.policy.cost.observe(key, seconds_by_shape[key], batch=count)
        for phase, measured in (("encode", result.encode_seconds), ("decode", result.decode_seconds)):
            for rid, seconds in measured.items():
                if rid in jobs:
                    self.policy.cost.observe_phase(shape_key(jobs[rid].request), phase, seconds)
