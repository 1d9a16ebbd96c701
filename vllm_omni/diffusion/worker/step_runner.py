"""Step execution: requests join and leave a diffusion worker's work at every denoise-step boundary.

In request mode a forward runs its requests from encode to decode, so a request that arrives meanwhile waits
for all of it. In step mode the worker keeps one resident `DenoiseState` per request (each with its own
scheduler and timesteps) and runs rounds:

    retire   aborted requests leave (their memory is freed); finished states are decoded, output sent at once
    admit    the scheduling policy (`diffusion/sched/step_policy.py`) picks the jobs (at most `max_num_seqs`)
             that step next: waiting requests join (encode, initial latents), paused states resume, and a
             resident state left out (a more urgent request took its slot, or under slo co-running would not
             pay) is paused (it keeps its latents; no recompute)
    advance  every resident state takes one denoise step: states with equal `forward_group_key` share ONE
             transformer forward (`denoise_step_batch`), at most `diffusion_max_tokens_per_forward` tokens each
    retire   as above, so an output leaves right after its last step

The worker polls its input between rounds, so a new request starts at the next step boundary. Each state keeps
its own timesteps, guidance and scheduler inside a shared forward, so a request's output is the one it has
alone (bitwise with a cap of 1, one forward per state); a request that raises inside a step is retired with its
error while the others go on unaffected.

On more than one rank (TP / sequence / CFG parallel) every rank runs the same rounds; rank 0 decides which
batches exist, which requests are aborted and which jobs step, and the others follow (`step_sync.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.distributed.rank_errors import RanksDesynchronized, agree_on_failures
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.step_policy import DEFAULT_STEPS, ShapeKey, StepPolicy, shape_key, shape_label
from vllm_omni.diffusion.step_context import PartialSink, StepContext
from vllm_omni.errors import RequestAbortedError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import StepStats

if TYPE_CHECKING:
    from vllm_omni.diffusion.state import DenoiseState
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.step_sync import JobKey, RankSync

logger = init_logger(__name__)

SendOutputs = Callable[[int, list[DiffusionOutput]], None]
"""(batch_id, one output per request of the batch, in batch order) -> None."""


class AbortSet(Protocol):
    """The worker's aborted (batch_id, request_id) pairs, filled by its abort side channel."""

    def contains(self, batch_id: int, request_id: str) -> bool: ...

    def forget_through(self, batch_id: int) -> None: ...


@dataclass
class _Batch:
    """One message from the engine; its result goes back once every request in it has an output."""

    batch_id: int
    outputs: list[DiffusionOutput | None]

    @property
    def complete(self) -> bool:
        return all(out is not None for out in self.outputs)


@dataclass(eq=False)
class _Job:
    """One request from admission to its output."""

    batch: _Batch
    index: int
    request: OmniDiffusionRequest
    ctx: StepContext
    deadline_ms: float
    arrival: float = field(default_factory=time.perf_counter)
    state: DenoiseState | None = None
    denoise_start: float = 0.0
    stats: StepStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = StepStats(shape_label(shape_key(self.request)))

    @property
    def deadline(self) -> float:
        return self.arrival + self.deadline_ms / 1000.0

    @property
    def prepared(self) -> bool:
        return self.state is not None

    @property
    def remaining_steps(self) -> int:
        if self.state is None:
            return self.request.sampling_params.num_inference_steps or DEFAULT_STEPS
        return len(self.state.timesteps) - self.state.step_index


class StepExecutor:
    """The resident states of one worker and the rounds that advance them (`sync`: the rank-0 decisions of a
    multi-rank stage; None on one rank)."""

    def __init__(self, runner: DiffusionModelRunner, send: SendOutputs, aborted: AbortSet,
                 sync: RankSync | None = None) -> None:
        self.runner = runner
        self.max_resident = runner.od_config.max_num_seqs
        self.max_tokens = runner.od_config.diffusion_max_tokens_per_forward
        self.send = send
        self.aborted = aborted
        self.policy = StepPolicy(runner.od_config.diffusion_scheduler_policy,
                                 starvation_factor=runner.od_config.slo_starvation_factor)
        self.waiting: list[_Job] = []
        """Not admitted yet, in arrival order."""
        self.paused: list[_Job] = []
        """Preempted: prepared states that wait for a step slot again."""
        self.resident: list[_Job] = []
        """The states that take a step this round, most urgent first."""
        self._batches: dict[int, _Batch] = {}
        self.sync = sync
        self._round_aborts: set[tuple[int, str]] = set()
        """Under `sync`: the aborts rank 0 decided for the current round."""
        self._failed: dict[_Job, DiffusionOutput] = {}
        """Under `sync`: the jobs this phase failed on this rank, held until the ranks agree (`_settle`)."""

    @property
    def batch_ids(self) -> set[int]:
        """Batches added and not complete yet."""
        return set(self._batches)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.paused or self.resident)

    def add(self, batch_id: int, requests: list[OmniDiffusionRequest], partial_sink: PartialSink | None) -> None:
        """Queue a batch's requests; each is admitted on its own at a step boundary."""
        batch = _Batch(batch_id, [None] * len(requests))
        self._batches[batch_id] = batch
        for index, request in enumerate(requests):
            ctx = StepContext(self.runner.od_config, request_ids=[request.request_id], partial_sink=partial_sink,
                              abort_requested=lambda rid, b=batch_id: self._is_aborted(b, rid),
                              abort_agreed=self.sync is not None)
            deadline_ms = request.sampling_params.deadline_ms or self.runner.od_config.default_deadline_ms
            self.waiting.append(_Job(batch, index, request, ctx, deadline_ms))
        if not requests:
            self._complete(batch)

    @torch.inference_mode()
    def run_round(self) -> None:
        """Retire, admit, advance every resident state by one step, retire."""
        if self.sync is not None:
            self._round_aborts = self.sync.start_round(list(self._batches), self._live_aborts())
        self._retire()
        self._admit()
        self._advance()
        self._retire()

    # ---- round phases ---------------------------------------------------------------------------------------

    def _retire(self) -> None:
        """Aborted requests leave with `RequestAbortedError`; finished states are decoded and sent."""
        for job in [job for job in self.paused if job.ctx.aborted([job.request.request_id])]:
            self._finish(job, DiffusionOutput.from_exception(RequestAbortedError()))
        decoded: dict[_Job, DiffusionOutput] = {}
        for job in list(self.resident):
            state = job.state
            state.drop(set(job.ctx.aborted(state.request_ids)))
            if not state.requests:
                self._finish(job, DiffusionOutput.from_exception(RequestAbortedError()))
            elif state.done:
                job.ctx.step_index = job.ctx.timestep = None
                start = time.perf_counter()
                state.durations["denoise"] = start - job.denoise_start
                outputs = self._guarded(job, lambda job=job: self._pipeline().finish(job.state, job.ctx))
                decoded[job] = None
                if outputs is not None:
                    self.policy.cost.observe_phase(shape_key(job.request), "decode", time.perf_counter() - start)
                    decoded[job] = outputs[0]
        if decoded:
            self._settle({job: out for job, out in decoded.items() if out is not None})

    def _admit(self) -> None:
        """Aborted waiting requests leave; the policy's choice (<= `max_num_seqs` jobs) becomes the resident set:
        resident jobs it left out are paused, paused ones it chose resume, waiting ones it chose are prepared."""
        for job in [job for job in self.waiting if job.ctx.aborted([job.request.request_id])]:
            self.waiting.remove(job)
            self._finish(job, DiffusionOutput.from_exception(RequestAbortedError()))
        chosen = []
        if self.sync is None or self.sync.is_leader:
            chosen = self.policy.choose(self.resident, self.paused, self.waiting, self.max_resident,
                                        self.runner.od_config.max_paused_states, time.perf_counter())
        if self.sync is not None:
            chosen = self._agreed(chosen)
        chosen_ids = {id(job) for job in chosen}
        for job in self.resident:
            if id(job) not in chosen_ids:
                job.stats.preemptions += 1
                logger.debug("[diffusion step] request %s paused at step %d", job.request.request_id,
                             job.state.step_index)
        self.paused = [job for job in self.paused + self.resident if id(job) not in chosen_ids]
        self.waiting = [job for job in self.waiting if id(job) not in chosen_ids]
        self.resident = list(chosen)
        new = [job for job in chosen if job.state is None]
        for job in new:
            job.state = self._guarded(job, lambda job=job: self._prepare(job))
            job.denoise_start = time.perf_counter()
        if new:
            self._settle()

    def _advance(self) -> None:
        """Every resident state takes one step: one transformer forward per group of compatible states (equal
        `step_group_key`), split where a group's tokens exceed `diffusion_max_tokens_per_forward`. The cost model
        learns what one step of the round's states of each shape cost (the seconds of their forwards)."""
        if not self.resident:
            return
        if self.runner.pipeline is None:
            for job in list(self.resident):
                self._guarded(job, self._pipeline)
            self._settle()
            return
        pipeline = self.runner.pipeline
        states: dict[ShapeKey, int] = {}
        seconds_by_shape: dict[ShapeKey, float] = {}
        for group in self._forward_groups(pipeline):
            start = time.perf_counter()
            errors = pipeline.denoise_step_batch([job.state for job in group], [job.ctx for job in group])
            seconds = time.perf_counter() - start  # each state of a shared forward waited for all of it
            stepped = [job for job, error in zip(group, errors, strict=True) if error is None]
            for job, error in zip(group, errors, strict=True):
                if error is not None:
                    self._fail(job, error)
            for job in stepped:
                job.stats.step_seconds.append(seconds)
                states[shape_key(job.request)] = states.get(shape_key(job.request), 0) + 1
            for key in {shape_key(job.request) for job in stepped}:
                seconds_by_shape[key] = seconds_by_shape.get(key, 0.0) + seconds
        for key, count in states.items():  # what one step of `count` states of this shape cost this round
            self.policy.cost.observe(key, seconds_by_shape[key], batch=count)
        self._settle()

    def _forward_groups(self, pipeline) -> list[list[_Job]]:
        """Resident states grouped by `forward_group_key` (None: alone), in residence order, each group cut into
        forwards of at most `max_tokens` tokens (a state larger than that runs alone)."""
        keyed: dict[object, list[tuple[_Job, int]]] = {}
        for job in list(self.resident):
            planned = self._guarded(job, lambda job=job: (pipeline.forward_group_key(job.state),
                                                          pipeline.step_tokens(job.state)))
            if planned is not None:
                key, tokens = planned
                keyed.setdefault((None, id(job)) if key is None else key, []).append((job, tokens))
        return [chunk for members in keyed.values() for chunk in split_by_tokens(members, self.max_tokens)]

    # ---- rank-0 decisions (multi-rank) ---------------------------------------------------------------------------

    def _is_aborted(self, batch_id: int, request_id: str) -> bool:
        if self.sync is None:
            return self.aborted.contains(batch_id, request_id)
        return (batch_id, request_id) in self._round_aborts

    def _live_aborts(self) -> set[tuple[int, str]]:
        jobs = self.waiting + self.paused + self.resident
        return {(job.batch.batch_id, job.request.request_id) for job in jobs
                if self.aborted.contains(job.batch.batch_id, job.request.request_id)}

    def _agreed(self, chosen: list[_Job]) -> list[_Job]:
        """Rank 0's chosen jobs, as this rank's job objects."""
        by_key = {(job.batch.batch_id, job.index): job for job in self.waiting + self.paused + self.resident}
        return [by_key[key] for key in self.sync.agree([(job.batch.batch_id, job.index) for job in chosen])]

    def _prepare(self, job: _Job) -> DenoiseState:
        pipeline = self._pipeline()
        pipeline.group_key(job.request)  # validates the request alone (OmniClientError naming the field)
        admitted = time.perf_counter()
        state = pipeline.prepare([job.request], job.ctx)
        state.durations["step_admission_wait"] = admitted - job.arrival
        self.policy.cost.observe_phase(shape_key(job.request), "encode", time.perf_counter() - admitted)
        return state

    def _pipeline(self):
        """The loaded pipeline; a state resident while the worker sleeps at level 2 fails with this error."""
        if self.runner.pipeline is None:
            raise RuntimeError("the diffusion worker is asleep; call wake_up() first")
        return self.runner.pipeline

    def _guarded(self, job: _Job, fn: Callable[[], object]) -> object:
        """`fn()`, or None after retiring `job` with the error it raised (the other states are untouched)."""
        try:
            return fn()
        except Exception as exc:
            self._fail(job, exc)
            return None

    def _fail(self, job: _Job, exc: Exception) -> None:
        logger.info("[diffusion step] request %s failed: %s", job.request.request_id, exc)
        if self.sync is None:
            self._finish(job, DiffusionOutput.from_exception(exc))
            return
        for jobs in (self.resident, self.paused, self.waiting):  # the rest of this phase skips it
            if job in jobs:
                jobs.remove(job)
        self._failed[job] = DiffusionOutput.from_exception(exc)

    def _settle(self, decoded: dict[_Job, DiffusionOutput] | None = None) -> None:
        """End of a phase: finish the jobs that failed (and the `decoded` ones). Under `sync` every rank runs
        this at the same phases and the ranks first agree on what failed (`distributed/rank_errors.py`); when
        they failed differently, the failed requests get the earliest failure and `RanksDesynchronized` ends
        the worker."""
        decoded = decoded or {}
        failed, self._failed = self._failed, {}
        if self.sync is not None:
            jobs = {_key(job): job for job in [*failed, *decoded, *self.waiting, *self.paused, *self.resident]}
            try:
                failed = {jobs[key]: out for key, out in
                          agree_on_failures({_key(job): out for job, out in failed.items()}).items()}
            except RanksDesynchronized as exc:
                batches, send = exc.batches, self.send
                self.send = lambda batch_id, outputs: batches.append((batch_id, outputs))
                for key, out in exc.outputs.items():  # the batches this completes go out from every rank
                    if key in jobs:
                        self._finish(jobs[key], out)
                self.send = send
                raise
        for job, out in failed.items():
            self._finish(job, out)
        for job, out in decoded.items():
            if job not in failed:
                self._finish(job, out)

    def _finish(self, job: _Job, output: DiffusionOutput) -> None:
        """Free the job's state and send its batch's result once the batch is complete."""
        for jobs in (self.resident, self.paused, self.waiting):
            if job in jobs:
                jobs.remove(job)
        job.state = None
        now = time.perf_counter()
        output.stage_durations.setdefault("forward", now - job.arrival)
        job.stats.deadline_missed = output.error is None and now > job.deadline and (
            job.request.sampling_params.deadline_ms is not None or self.policy.policy == "slo")
        job.stats.waiting, job.stats.running = len(self.waiting) + len(self.paused), len(self.resident)
        output.step_stats = job.stats
        output.peak_memory_mb = self.runner.peak_memory_mb()
        job.batch.outputs[job.index] = output
        if job.batch.complete:
            self._complete(job.batch)

    def _complete(self, batch: _Batch) -> None:
        del self._batches[batch.batch_id]
        self.send(batch.batch_id, batch.outputs)
        # Aborts are kept for every batch still here (an abort may also arrive after its batch ended).
        self.aborted.forget_through(min(self._batches, default=batch.batch_id + 1) - 1)


def _key(job: _Job) -> JobKey:
    return job.batch.batch_id, job.index


def split_by_tokens(members: list[tuple[_Job, int]], max_tokens: int | None) -> list[list[_Job]]:
    """Consecutive forwards of (job, tokens) members, each within `max_tokens` (None: one forward)."""
    chunks: list[list[_Job]] = []
    used = 0
    for job, tokens in members:
        if not chunks or (max_tokens is not None and used + tokens > max_tokens):
            chunks.append([])
            used = 0
        chunks[-1].append(job)
        used += tokens
    return chunks
