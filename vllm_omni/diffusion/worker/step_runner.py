"""Step execution on one worker rank: the rank's `DenoiseState`s, kept by request id, and the plans that move them.

In request mode a forward runs its requests from encode to decode, so a request that arrives meanwhile waits for
all of it. In step mode the engine's `DiffusionScheduler` (`diffusion/core/scheduler.py`) decides every round and sends
the same `StepPlan` to every rank; a rank executes it in four phases:

    drop     the plan's aborted requests leave (their states are freed)
    admit    the plan's new requests are prepared (encode, initial latents); a resident state the plan does not
             step stays paused (it keeps its latents; no recompute)
    advance  every state the plan steps takes one denoise step: states with equal `forward_group_key` share ONE
             transformer forward (`denoise_step_batch`), at most `diffusion_max_tokens_per_forward` tokens each
    retire   finished states are decoded; their outputs leave in this round's `StepResult`

Each state keeps its own timesteps, guidance and scheduler inside a shared forward, so a request's output is the
one it has alone (bitwise with a cap of 1, one forward per state); a request that raises inside a phase is
retired with its error while the others go on unaffected. Everything a phase does depends only on the plan and
the states, so every rank does the same; on more than one rank the ranks compare what failed after each phase
(`distributed/rank_errors.py`), and a split ends the round with `out_of_step` set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.distributed.rank_errors import RanksDesynchronized, agree_on_failures
from vllm_omni.diffusion.ipc import StepPlan, StepResult
from vllm_omni.diffusion.layers.compile import compile_stats
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import PartialSink, StepContext
from vllm_omni.diffusion.timing import synchronized_now
from vllm_omni.errors import RequestAbortedError
from vllm_omni.logger import init_logger

if TYPE_CHECKING:
    from vllm_omni.diffusion.state import DenoiseState
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

logger = init_logger(__name__)


@dataclass(eq=False)
class Resident:
    """One admitted request on this rank: its context and, once prepared, its state."""

    request: OmniDiffusionRequest
    ctx: StepContext
    state: DenoiseState | None = None
    denoise_start: float = 0.0


class StepWorker:
    """This rank's states by request id (vLLM's persistent batch) and the execution of each round's plan."""

    def __init__(self, runner: DiffusionModelRunner, rank: int = 0, multi_rank: bool = False) -> None:
        self.runner = runner
        self.rank = rank
        self.max_tokens = runner.od_config.diffusion_max_tokens_per_forward
        self.multi_rank = multi_rank
        self.states: dict[str, Resident] = {}
        self._dropping: frozenset[str] = frozenset()
        """The current plan's aborts: what `StepContext.aborted` answers on every rank alike."""
        self._failed: dict[str, DiffusionOutput] = {}
        self._result: StepResult | None = None

    @torch.inference_mode()
    def execute(self, plan: StepPlan, partial_sink: PartialSink | None = None) -> StepResult:
        """Drop, admit, advance, retire; the result has `out_of_step` set when the ranks failed differently."""
        result = self._result = StepResult(round_id=plan.round_id, rank=self.rank, outputs={}, progress={},
                                           forwards=[], encode_seconds={}, decode_seconds={})
        self._dropping = frozenset(plan.abort)
        try:
            for rid in plan.abort:
                if self.states.pop(rid, None) is not None:
                    result.outputs[rid] = DiffusionOutput.from_exception(RequestAbortedError())
            self._admit(plan, partial_sink)
            stepped = [self.states[rid] for rid in plan.step if rid in self.states]
            self._advance(stepped)
            self._retire(stepped)
        except RanksDesynchronized as exc:
            result.outputs.update((rid, out) for rid, out in exc.outputs.items())
            for rid in exc.outputs:
                self.states.pop(rid, None)
            result.out_of_step = str(exc)
        for rid, resident in self.states.items():
            if resident.state is not None:
                result.progress[rid] = (resident.state.step_index, len(resident.state.timesteps))
        peak, compiled = self.runner.peak_memory_mb(), compile_stats(self.runner.pipeline)
        for output in result.outputs.values():
            output.peak_memory_mb = peak
            output.compile_stats = compiled
        self._result = None
        return result

    # ---- phases -------------------------------------------------------------------------------------------------

    def _admit(self, plan: StepPlan, partial_sink: PartialSink | None) -> None:
        streamed = set(plan.stream)
        for request in plan.new:
            rid = request.request_id
            ctx = StepContext(self.runner.od_config, request_ids=[rid],
                              partial_sink=partial_sink if rid in streamed else None,
                              abort_requested=self._is_dropping, abort_agreed=True)
            resident = Resident(request, ctx)
            self.states[rid] = resident
            resident.state = self._guarded(resident, lambda r=resident: self._prepare(r))
            resident.denoise_start = time.perf_counter()
        if plan.new:
            self._settle()

    def _advance(self, stepped: list[Resident]) -> None:
        stepped = [r for r in stepped if r.request.request_id in self.states]
        if not stepped:
            return
        if self.runner.pipeline is None:
            for resident in stepped:
                self._guarded(resident, self._pipeline)
            self._settle()
            return
        pipeline = self.runner.pipeline
        for group in self._forward_groups(pipeline, stepped):
            start = time.perf_counter()
            errors = pipeline.denoise_step_batch([r.state for r in group], [r.ctx for r in group])
            seconds = time.perf_counter() - start
            for resident, error in zip(group, errors, strict=True):
                if error is not None:
                    self._fail(resident, error)
            ok = [r.request.request_id for r, error in zip(group, errors, strict=True) if error is None]
            if ok:
                self._result.forwards.append((ok, seconds))
        self._settle()

    def _retire(self, stepped: list[Resident]) -> None:
        decoded: dict[str, DiffusionOutput] = {}
        finishing = [r for r in stepped if r.request.request_id in self.states and r.state.done]
        for resident in finishing:
            rid = resident.request.request_id
            resident.ctx.step_index = resident.ctx.timestep = None
            # Its last steps may still be queued on the device: they belong to the denoise, not to the decode
            # (the cost model's decode estimate read ~3x request mode's when this clock started before them).
            start = synchronized_now(resident.state.latents.device)
            resident.state.durations["denoise"] = start - resident.denoise_start
            outputs = self._guarded(resident, lambda r=resident: self._pipeline().finish(r.state, r.ctx))
            if outputs is not None:
                self._result.decode_seconds[rid] = time.perf_counter() - start
                decoded[rid] = outputs[0]
        if finishing:  # the same on every rank, whatever failed where
            self._settle(decoded)

    def _forward_groups(self, pipeline, stepped: list[Resident]) -> list[list[Resident]]:
        """The stepped states grouped by `forward_group_key` (None: alone), in plan order, each group cut into
        forwards of at most `max_tokens` tokens (a state larger than that runs alone)."""
        keyed: dict[object, list[tuple[Resident, int]]] = {}
        for resident in stepped:
            planned = self._guarded(resident, lambda r=resident: (pipeline.forward_group_key(r.state),
                                                                  pipeline.step_tokens(r.state)))
            if planned is not None:
                key, tokens = planned
                keyed.setdefault((None, id(resident)) if key is None else key, []).append((resident, tokens))
        return [chunk for members in keyed.values() for chunk in split_by_tokens(members, self.max_tokens)]

    # ---- failures -----------------------------------------------------------------------------------------------

    def _prepare(self, resident: Resident) -> DenoiseState:
        pipeline = self._pipeline()
        pipeline.group_key(resident.request)  # validates the request alone (OmniClientError naming the field)
        start = time.perf_counter()
        state = pipeline.prepare([resident.request], resident.ctx)
        self._result.encode_seconds[resident.request.request_id] = time.perf_counter() - start
        return state

    def _pipeline(self):
        """The loaded pipeline; a state resident while the worker sleeps at level 2 fails with this error."""
        if self.runner.pipeline is None:
            raise RuntimeError("the diffusion worker is asleep; call wake_up() first")
        return self.runner.pipeline

    def _guarded(self, resident: Resident, fn: Callable[[], object]) -> object:
        """`fn()`, or None after retiring `resident` with the error it raised (the other states are untouched)."""
        try:
            return fn()
        except Exception as exc:
            self._fail(resident, exc)
            return None

    def _fail(self, resident: Resident, exc: Exception) -> None:
        rid = resident.request.request_id
        logger.info("[diffusion step] request %s failed: %s", rid, exc)
        self.states.pop(rid, None)  # the rest of this phase skips it
        self._failed[rid] = DiffusionOutput.from_exception(exc)

    def _settle(self, decoded: dict[str, DiffusionOutput] | None = None) -> None:
        """End of a phase: on more than one rank the ranks first agree on what failed; the failed and the decoded
        requests leave with their outputs."""
        decoded = decoded or {}
        failed, self._failed = self._failed, {}
        if self.multi_rank:
            failed = agree_on_failures(failed)  # RanksDesynchronized: `execute` ends the round
        for rid, output in failed.items():
            self.states.pop(rid, None)
            self._result.outputs[rid] = output
        for rid, output in decoded.items():
            if rid not in failed:
                self.states.pop(rid, None)
                self._result.outputs[rid] = output

    def _is_dropping(self, request_id: str) -> bool:
        return request_id in self._dropping


def split_by_tokens(members: list[tuple[object, int]], max_tokens: int | None) -> list[list[object]]:
    """Consecutive forwards of (job, tokens) members, each within `max_tokens` (None: one forward)."""
    chunks: list[list[object]] = []
    used = 0
    for job, tokens in members:
        if not chunks or (max_tokens is not None and used + tokens > max_tokens):
            chunks.append([])
            used = 0
        chunks[-1].append(job)
        used += tokens
    return chunks
