"""Scheduling policies: which requests a diffusion stage serves first (`--diffusion-scheduler-policy`).

In step mode, at every step boundary the engine's `DiffusionScheduler` asks its `StepPolicy` which jobs (resident,
paused or waiting) take a step in the next round (at most `max_num_seqs`), as below. In request mode the same
`urgency` (with the same deadlines, cost model and starvation bound) orders the queue of whole requests: the most
urgent one picks the next batch.

    fcfs      arrival order; a resident state is never paused (the resident states share the rounds)
    priority  vLLM's priority scheduling: lower `priority` first, then arrival; the `max_num_seqs` most urgent
              jobs share the rounds
    slo       earliest deadline first (a request's `deadline_ms`, else arrival + `deadline_factor` x its solo
              time as the cost model estimates it: `--slo-deadline-factor`), a job whose estimated remaining
              cost no longer fits before its deadline (hopeless) behind every job that can still make its own,
              until it is late by more than `starvation_factor` x its deadline window (deadline - arrival):
              then it runs before every other job (the starvation bound); the most urgent job runs ALONE
              unless co-batching pays: jobs of its shape join it only while their measured batched step is at
              most `COBATCH_GAIN` x the sum of their solo steps (and the jobs that could make their deadline
              still do); a batch size not measured yet is tried once, after the shape's solo step was measured

Why slo does not share rounds: a DiT forward at 512^2 and above is compute-bound, so k states advancing together
make each of them k times slower (processor sharing), which raises mean latency above run-to-completion. Running
the earliest deadline alone, with deadlines proportional to solo time, serves short jobs first (shortest job
first), which is what cuts mean latency below FCFS; co-batching is kept for the small shapes where one batched
forward costs well below the solo forwards it replaces.

A resident state left out of a round is paused (preempted) with its latents and scheduler and resumes where it
stopped; at most `max_paused_states` states are paused at a time, which bounds the states a worker holds.
Remaining cost = remaining steps x the measured seconds per step of the request's shape (`StepCostModel`),
plus the shape's measured decode and, before admission, its measured encode (prepare).

Admission control (`--slo-admission-control`, slo only): a newcomer is refused at `add` when, run after every
queued job whose deadline is not later than its own (EDF), the cost model predicts it finishes after its
deadline (request mode: after the batch in flight too, which is never preempted). So that refusing never costs
more than a stated share of throughput, at most 1 - `min_accept` of the last `ADMISSION_WINDOW` arrivals are
refused (`--slo-admission-min-accept`); one that would exceed it is admitted and served late. The simulator's
admission rows (benchmarks/diffusion/sim_step_policies.py) apply the same `AdmissionControl`.

Why the starvation bound: putting hopeless jobs last is what lets the feasible ones meet their deadlines under
overload, but with no bound a long hopeless job waits as long as feasible work keeps arriving, which is the
p95/p99 (benchmarks/diffusion/sim_step_policies.py replays the H200 mix: docs/execution_modes.md).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from vllm_omni.diffusion.request import OmniDiffusionRequest

Policy = Literal["fcfs", "priority", "slo"]
POLICIES: tuple[str, ...] = ("fcfs", "priority", "slo")
DEFAULT_STEPS = 50
"""Steps assumed for a waiting request that leaves `num_inference_steps` to the pipeline (diffusers' default)."""
COBATCH_GAIN = 0.8
"""slo co-batches k states of one shape only when their measured round costs at most this x k solo steps."""
ShapeKey = tuple[int | None, int | None, int | None, bool]
ADMISSION_WINDOW = 100
"""Arrivals over which slo admission control keeps its refused share at most 1 - `min_accept`."""


def shape_key(request: OmniDiffusionRequest) -> ShapeKey:
    """What a step's cost depends on: width, height, frames and whether CFG doubles the forward."""
    sp = request.sampling_params
    return sp.width, sp.height, sp.num_frames, request.negative_prompt is not None


def shape_label(key: ShapeKey) -> str:
    """ "1024x1024", "832x480x81f", "+cfg" appended: the metrics label of a shape (None = pipeline default)."""
    width, height, frames, cfg = key
    label = f"{width or 'default'}x{height or 'default'}" + (f"x{frames}f" if frames else "")
    return label + ("+cfg" if cfg else "")


Phase = Literal["encode", "decode"]


@dataclass
class StepCostModel:
    """Seconds of one step of `batch` states of a shape (all their forwards in a round), and of a shape's
    per-request encode (prepare) and decode (finish): exponentially weighted moving averages of what was
    measured."""

    alpha: float = 0.3
    """Weight of the newest measurement."""
    seconds: dict[tuple[ShapeKey, int], float] = field(default_factory=dict)
    phases: dict[tuple[ShapeKey, Phase], float] = field(default_factory=dict)

    def observe(self, key: ShapeKey, seconds: float, batch: int = 1) -> None:
        self.seconds[key, batch] = self._average(self.seconds.get((key, batch)), seconds)

    def observe_phase(self, key: ShapeKey, phase: Phase, seconds: float) -> None:
        self.phases[key, phase] = self._average(self.phases.get((key, phase)), seconds)

    def phase_seconds(self, key: ShapeKey, phase: Phase) -> float:
        """The measured encode / decode of a shape (0 before its first)."""
        return self.phases.get((key, phase), 0.0)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def measured(self, key: ShapeKey, batch: int) -> float | None:
        return self.seconds.get((key, batch))

    def step_seconds(self, key: ShapeKey, batch: int = 1) -> float:
        """The measured cost; an unmeasured solo step is scaled by pixels from the measured solo steps of other
        shapes (0 before any); an unmeasured batch costs `batch` solo steps (no gain assumed)."""
        if (key, batch) in self.seconds:
            return self.seconds[key, batch]
        if batch != 1:
            return batch * self.step_seconds(key)
        sized = [(k, s) for (k, n), s in self.seconds.items() if n == 1 and _pixels(k) and k[3] == key[3]]
        if not sized or not _pixels(key):
            return 0.0
        per_pixel = sum(s / _pixels(k) for k, s in sized) / len(sized)
        return per_pixel * _pixels(key)


def _pixels(key: ShapeKey) -> int:
    width, height, frames, _ = key
    return (width or 0) * (height or 0) * (frames or 1)


class Schedulable(Protocol):
    """What a policy reads of a job."""

    request: OmniDiffusionRequest
    arrival: float
    deadline: float
    """Absolute (perf_counter) time by which the request should be done."""

    @property
    def remaining_steps(self) -> int: ...

    @property
    def prepared(self) -> bool:
        """Encoded and holding latents (resident or paused)."""
        ...


class StepPolicy:
    def __init__(
        self,
        policy: Policy,
        cost: StepCostModel | None = None,
        starvation_factor: float = math.inf,
        default_deadline_ms: float = 60000.0,
        deadline_factor: float = 0.0,
    ) -> None:
        """`starvation_factor`: the slo starvation bound (`--slo-starvation-factor`); inf = hopeless jobs wait
        behind every feasible one. `deadline_factor`: a request without `deadline_ms` is given `deadline_factor`
        x its estimated solo time (`--slo-deadline-factor`; 0 = `default_deadline_ms`)."""
        if policy not in POLICIES:
            raise ValueError(f"diffusion_scheduler_policy must be one of {list(POLICIES)}, got {policy!r}")
        if not starvation_factor >= 0:
            raise ValueError(f"slo_starvation_factor must be >= 0, got {starvation_factor}")
        self.policy = policy
        self.cost = cost or StepCostModel()
        self.starvation_factor = starvation_factor
        self.default_deadline_ms = default_deadline_ms
        self.deadline_factor = deadline_factor

    def solo_seconds(self, request: OmniDiffusionRequest) -> float:
        """The cost model's estimate of `request` served alone from arrival: encode, every step, decode (0 while
        nothing that prices its step was measured)."""
        key = shape_key(request)
        steps = request.sampling_params.num_inference_steps or DEFAULT_STEPS
        step = self.cost.step_seconds(key)
        if step == 0.0:
            return 0.0
        return self.cost.phase_seconds(key, "encode") + steps * step + self.cost.phase_seconds(key, "decode")

    def deadline_ms(self, request: OmniDiffusionRequest) -> float:
        """The request's deadline after its arrival: its own `deadline_ms`; else (`deadline_factor` > 0 and a
        cost estimate) `deadline_factor` x its estimated solo time, so that under slo a short request overtakes
        a long one without a client deadline; else `default_deadline_ms`."""
        if request.sampling_params.deadline_ms:
            return request.sampling_params.deadline_ms
        solo = self.solo_seconds(request) if self.deadline_factor > 0 else 0.0
        return self.deadline_factor * solo * 1000.0 if solo > 0 else self.default_deadline_ms

    def remaining_seconds(self, job: Schedulable, batch: int = 1) -> float:
        """Remaining steps at the measured pace of `batch` states, then decode; encode too before admission."""
        key = shape_key(job.request)
        fixed = self.cost.phase_seconds(key, "decode")
        if not job.prepared:
            fixed += self.cost.phase_seconds(key, "encode")
        return job.remaining_steps * self.cost.step_seconds(key, batch) + fixed

    def can_make_deadline(self, job: Schedulable, now: float, batch: int = 1) -> bool:
        return now + self.remaining_seconds(job, batch) <= job.deadline

    def slo_tier(self, job: Schedulable, now: float) -> int:
        """0: late by more than `starvation_factor` x its deadline window (it runs first: the bound on a hopeless
        job's wait); 1: can still make its deadline; 2: hopeless, not starved yet."""
        if self.can_make_deadline(job, now):
            return 1
        return 0 if now > job.deadline + self.starvation_factor * (job.deadline - job.arrival) else 2

    def urgency(self, job: Schedulable, now: float) -> tuple:
        """Sort key, most urgent first."""
        if self.policy == "priority":
            return job.request.sampling_params.priority, job.arrival
        if self.policy == "slo":
            return self.slo_tier(job, now), job.deadline, job.arrival
        return (job.arrival,)

    def choose(self, running: list, paused: list, waiting: list, slots: int, max_paused: int, now: float) -> list:
        """The jobs that take a step next round, most urgent first."""
        if self.policy == "fcfs":
            return running + waiting[: max(slots - len(running), 0)]
        ranked = sorted(running + paused + waiting, key=lambda job: self.urgency(job, now))
        if self.policy == "slo" and ranked:
            return self._choose_slo(ranked, [*running, *paused], slots, max_paused, now)
        return self._keep_paused_bound(ranked, ranked[:slots], waiting, slots, max_paused, now)

    def _keep_paused_bound(
        self, ranked: list, chosen: list, waiting: list, slots: int, max_paused: int, now: float
    ) -> list:
        """`chosen`, where leaving out more than `max_paused` prepared jobs would pause one more: then the least
        urgent newcomers give way to the most urgent held states (and free slots are filled with held states)."""
        chosen_ids = {id(job) for job in chosen}
        waiting_ids = {id(job) for job in waiting}
        holders = [job for job in ranked if id(job) not in chosen_ids and id(job) not in waiting_ids]
        fresh = [job for job in chosen if id(job) in waiting_ids]
        while len(holders) > max_paused and (fresh or len(chosen) < slots):
            if len(chosen) >= slots:
                chosen.remove(fresh.pop())
            chosen.append(holders.pop(0))
        return sorted(chosen, key=lambda job: self.urgency(job, now))

    def _choose_slo(self, ranked: list, prepared: list, slots: int, max_paused: int, now: float) -> list:
        """The most urgent job (a prepared one when admitting a newcomer would pause more than `max_paused`),
        joined by the most urgent jobs of its shape while co-batching them pays."""
        prepared_ids = {id(job) for job in prepared}
        head = ranked[0] if len(prepared) <= max_paused else next(j for j in ranked if id(j) in prepared_ids)
        key = shape_key(head.request)
        chosen = [head]
        for job in ranked:
            if len(chosen) >= slots:
                break
            if job is not head and shape_key(job.request) == key and self._cobatch_pays(chosen + [job], key, now):
                chosen.append(job)
        waiting = [job for job in ranked if id(job) not in prepared_ids]
        return self._keep_paused_bound(ranked, chosen, waiting, slots, max_paused, now)

    def _cobatch_pays(self, jobs: list, key: ShapeKey, now: float) -> bool:
        """k states of one shape share a round once the shape's solo step is measured: when k is not measured
        yet (one round measures it), or when their batched step is measured at most `COBATCH_GAIN` x k solo
        steps and no job that could make its deadline alone would miss it at the batched pace."""
        batch, solo = len(jobs), self.cost.measured(key, 1)
        batched = self.cost.measured(key, batch)
        if solo is None or batched is None:
            return solo is not None
        if batched > COBATCH_GAIN * batch * solo:
            return False
        return not any(self.can_make_deadline(job, now) and not self.can_make_deadline(job, now, batch) for job in jobs)


class AdmissionControl:
    """slo admission control: refuse a job that cannot make its deadline behind the work ahead of it, within the
    throughput floor `min_accept` (the least admitted share of the last `window` arrivals)."""

    def __init__(self, min_accept: float = 0.9, window: int = ADMISSION_WINDOW) -> None:
        """`min_accept`: the floor; 0 = none (the simulator's reference: refuse whatever cannot make it)."""
        if not 0 <= min_accept <= 1:
            raise ValueError(f"slo_admission_min_accept must be in [0, 1], got {min_accept}")
        self.min_accept = min_accept
        self.window = window
        self.refused: deque[bool] = deque(maxlen=window - 1)
        """Whether each of the previous arrivals was refused (this one completes the window)."""

    @staticmethod
    def predicted_finish(
        policy: StepPolicy, queue: list, job: Schedulable, now: float, running: tuple | list = ()
    ) -> float:
        """When `job` would finish run after every queued job with a deadline not later than its own (EDF) and
        after `running` (what cannot be preempted: request mode's batch in flight), at the cost model's solo
        pace (`now` while nothing prices its shape)."""
        ahead = sum(policy.remaining_seconds(j) for j in queue if j.deadline <= job.deadline)
        ahead += sum(policy.remaining_seconds(j) for j in running)
        return now + ahead + policy.remaining_seconds(job)

    def refuse(
        self, policy: StepPolicy, queue: list, job: Schedulable, now: float, running: tuple | list = ()
    ) -> float | None:
        """The predicted finish of a job to refuse; None admits it (it can make its deadline, or refusing it
        would refuse more than 1 - `min_accept` of the window's arrivals). Counts the arrival either way."""
        finish = self.predicted_finish(policy, queue, job, now, running)
        arrivals, refused = len(self.refused) + 1, sum(self.refused) + 1
        refuse = finish > job.deadline and arrivals - refused >= self.min_accept * arrivals - 1e-9
        self.refused.append(refuse)
        return finish if refuse else None
