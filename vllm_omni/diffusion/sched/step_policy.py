"""Step scheduling policies: which requests a step-mode worker serves first (`--diffusion-scheduler-policy`).

At every step boundary the `StepExecutor` asks its `StepPolicy` which jobs (resident, paused or waiting) hold
the `max_num_seqs` step slots of the next round:

    fcfs      arrival order; a resident state is never paused
    priority  vLLM's priority scheduling: lower `priority` first, then arrival
    slo       earliest deadline first; a job whose estimated remaining cost no longer fits before its
              deadline goes behind every job that can still make its own

A resident state left out of the slots is paused (preempted) with its latents and scheduler and resumes where it
stopped; at most `max_paused_states` states are paused at a time, which bounds the states a worker holds.
Remaining cost = remaining steps x the measured seconds per step of the request's shape (`StepCostModel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from vllm_omni.diffusion.request import OmniDiffusionRequest

Policy = Literal["fcfs", "priority", "slo"]
POLICIES: tuple[str, ...] = ("fcfs", "priority", "slo")
DEFAULT_STEPS = 50
"""Steps assumed for a waiting request that leaves `num_inference_steps` to the pipeline (diffusers' default)."""
ShapeKey = tuple[int | None, int | None, int | None, bool]


def shape_key(request: OmniDiffusionRequest) -> ShapeKey:
    """What a step's cost depends on: width, height, frames and whether CFG doubles the forward."""
    sp = request.sampling_params
    return sp.width, sp.height, sp.num_frames, request.negative_prompt is not None


def shape_label(key: ShapeKey) -> str:
    """"1024x1024", "832x480x81f", "+cfg" appended: the metrics label of a shape (None = pipeline default)."""
    width, height, frames, cfg = key
    label = f"{width or 'default'}x{height or 'default'}" + (f"x{frames}f" if frames else "")
    return label + ("+cfg" if cfg else "")


@dataclass
class StepCostModel:
    """Seconds per denoise step by shape: an exponentially weighted moving average of measured steps."""

    alpha: float = 0.3
    """Weight of the newest measurement."""
    seconds: dict[ShapeKey, float] = field(default_factory=dict)

    def observe(self, key: ShapeKey, seconds: float) -> None:
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def step_seconds(self, key: ShapeKey) -> float:
        """The measured cost; an unmeasured shape is scaled by pixels from the measured ones (0 before any)."""
        if key in self.seconds:
            return self.seconds[key]
        sized = [(k, s) for k, s in self.seconds.items() if _pixels(k) and k[3] == key[3]]
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


class StepPolicy:
    def __init__(self, policy: Policy, cost: StepCostModel | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"diffusion_scheduler_policy must be one of {list(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.cost = cost or StepCostModel()

    def remaining_seconds(self, job: Schedulable) -> float:
        return job.remaining_steps * self.cost.step_seconds(shape_key(job.request))

    def can_make_deadline(self, job: Schedulable, now: float) -> bool:
        return now + self.remaining_seconds(job) <= job.deadline

    def urgency(self, job: Schedulable, now: float) -> tuple:
        """Sort key, most urgent first."""
        if self.policy == "priority":
            return job.request.sampling_params.priority, job.arrival
        if self.policy == "slo":
            return not self.can_make_deadline(job, now), job.deadline, job.arrival
        return (job.arrival,)

    def choose(self, running: list, paused: list, waiting: list, slots: int, max_paused: int, now: float) -> list:
        """The jobs that hold the step slots next round, most urgent first. Under fcfs the running jobs keep
        theirs; otherwise a running job may lose its slot to a more urgent one, unless that would leave more than
        `max_paused` jobs paused (then the least urgent newcomers give way to the most urgent paused ones)."""
        if self.policy == "fcfs":
            return running + waiting[:max(slots - len(running), 0)]
        ranked = sorted(running + paused + waiting, key=lambda job: self.urgency(job, now))
        chosen = ranked[:slots]
        chosen_ids = {id(job) for job in chosen}
        holders = [job for job in ranked if id(job) not in chosen_ids and not any(job is w for w in waiting)]
        fresh = [job for job in chosen if any(job is w for w in waiting)]
        while len(holders) > max_paused and fresh:
            chosen.remove(fresh.pop())  # the least urgent newcomer gives way to the most urgent state
            chosen.append(holders.pop(0))
        return sorted(chosen, key=lambda job: self.urgency(job, now))
