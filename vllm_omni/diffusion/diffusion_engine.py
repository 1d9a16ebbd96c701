"""The diffusion stage's engine: validates requests, co-batches them, and runs them on the workers.

`submit` is thread-safe and returns a future per request; an optional `on_partial` callback receives the
request's partial results (`PartialResult`: denoise progress, decoded video chunks), all of them before the
future resolves. One loop drives everything, one pass per `run_once`, as vLLM's EngineCore busy loop: finish the
round whose result came (update the one `DiffusionScheduler` of `core/scheduler.py`, resolve the requests that
left), schedule and send the next round, then wait for the workers' results (or a death, a wake-up, the
caller's own sockets) and dispatch them. In step mode a round is a `StepPlan` every rank executes; in request
mode it is a batch of whole requests the workers run to their end. The diffusion core's busy loop calls
`run_once` (`own_loop=False`); in-process callers (tests, offline benchmarks) get a thread that does.

`abort` resolves the request's future at once and tells the workers, which stop it at the next denoise
step. When a worker dies, the requests it ran fail with `StageRestartingError` (503) and the engine
replaces its executor, up to `max_stage_restarts` times; queued and new requests wait for the new
workers. Past that budget the engine is dead (`EngineDeadError`, failure callbacks fire). Once the engine stops
(`close`, or `begin_shutdown` where its owner was signalled: a process group's SIGTERM reaches the workers too)
a worker's exit is expected: its requests fail and nothing restarts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import zmq

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.catalog.resolution import resolve_model_dir, resolve_pipeline_class_name
from vllm_omni.catalog.shapes import ShapeRule, load_shape_rule
from vllm_omni.diffusion.core.scheduler import DiffusionScheduler
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.executor import make_executor
from vllm_omni.diffusion.executor.multiproc_executor import MultiprocDiffusionExecutor
from vllm_omni.diffusion.interface import supports_request_batch, supports_step_execution
from vllm_omni.diffusion.ipc import PartialResult, StepPlan, StepResult
from vllm_omni.diffusion.model_loader.dummy import check_weights_present
from vllm_omni.diffusion.prompt_bound import PromptBound
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import EngineDeadError, OmniClientError, StageRestartingError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

_IDLE_WAIT_S = 1.0
"""Longest wait of the loop with nothing due (every event that matters wakes it earlier)."""
_LOOP_JOIN_TIMEOUT_S = 2.0
_CLOSE_TIMEOUT_S = 10.0
_RESTART_GRACE_S = 0.5
"""How long a restart waits, after a worker's death, for a stop that may come with it: a SIGTERM to the whole
process group reaches the workers and the core together, and the core's handler (`begin_shutdown`) can run after
the worker's death was seen."""


class DiffusionEngine:
    def __init__(self, od_config: OmniDiffusionConfig, own_loop: bool = True) -> None:
        """`own_loop`: run the loop on a thread of the engine's (in-process callers); the diffusion core drives
        `run_once` from its busy loop instead."""
        model_dir = resolve_model_dir(od_config.model, od_config.revision, od_config.load_format != "dummy")
        if od_config.load_format == "auto":
            check_weights_present(model_dir)  # one clear error here rather than a worker's load traceback
        self.model_class_name = resolve_pipeline_class_name(od_config, model_dir)
        self.output_modality = MODEL_REGISTRY.output_modality(self.model_class_name)
        self.input_modalities = MODEL_REGISTRY.input_modalities(self.model_class_name)
        target = MODEL_REGISTRY.pipeline_class_path(self.model_class_name, od_config.use_diffusers_adapter)
        pipeline_cls = MODEL_REGISTRY.load_pipeline_class(target)
        self.step_execution = od_config.step_execution and supports_step_execution(pipeline_cls)
        if od_config.step_execution and not self.step_execution:
            logger.warning(
                "%s cannot step: --step-execution is off for this stage and requests run in request "
                "mode (docs/execution_modes.md)",
                pipeline_cls.__name__,
            )
        _refuse_inert_flags(od_config, self.step_execution)
        # Resolved once here: the workers get the checkpoint directory and our class as "module:Class".
        self.od_config = dataclasses.replace(
            od_config, model=str(model_dir), model_class_name=target, step_execution=self.step_execution
        )
        entry = MODEL_REGISTRY.diffusion_entry(self.model_class_name)
        self.prompt_bound = (
            PromptBound.for_model(model_dir, entry.prompt_tokenizer, entry.max_prompt_tokens)
            if entry is not None and entry.max_prompt_tokens
            else None
        )
        """The text encoder's token limit, checked by the stage client off the event loop before `submit`."""
        rule = load_shape_rule(entry.shape_rule, model_dir) if entry is not None and entry.shape_rule else None
        self.supports_request_batch = supports_request_batch(pipeline_cls)
        if od_config.max_num_seqs > 1 and not (self.supports_request_batch or self.step_execution):
            raise ValueError(
                f"{pipeline_cls.__name__} (serving {self.model_class_name}) does not support request-level "
                f"batching. Use max_num_seqs=1 (got {od_config.max_num_seqs})."
            )
        self.scheduler = DiffusionScheduler(self.od_config)
        """Both modes' (request mode is its policy that never preempts)."""
        self._lock = threading.RLock()
        """Re-entrant: a future cancelled under it runs its done callbacks there, which may read `stats()`."""
        self._waiting: dict[str, tuple[Future[DiffusionOutput], float]] = {}
        self._running: dict[str, Future[DiffusionOutput]] = {}
        self._partial_callbacks: dict[str, Callable[[PartialResult], None]] = {}
        self._stop_waits: list[tuple[set[str], Future[None]]] = []
        """`when_stopped` futures and the requests each still waits for to leave the workers."""
        self._stopping = False
        self._shutting_down = False
        """Set by `begin_shutdown`: no restart from now on (`close` follows)."""
        self._dead = False
        self._restarting = False
        self._restarts = 0
        self._restart_thread: threading.Thread | None = None
        self._replacement: MultiprocDiffusionExecutor | BaseException | None = None
        """What the restart thread built (new workers, or why it could not); the loop swaps it in."""
        self._round: tuple[StepPlan, Future] | None = None
        """The round on the workers and the future of its result (one at a time, either mode)."""
        self._wake_r, self._wake_w = socket.socketpair()
        """A byte on it ends the loop's wait (closed sockets refuse writes: no stray fd after close)."""
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller: tuple[MultiprocDiffusionExecutor, tuple, zmq.Poller] | None = None
        self._counters: Counter[str] = Counter()
        self._batch_sizes: Counter[int] = Counter()
        self._failure_callbacks: list[Callable[[], None]] = []
        self._reserved: dict[str, int] = {}
        """Estimated bytes of each request on the workers (memory admission)."""
        self._queued: dict[str, float] = {}
        """Seconds each request on the workers waited in the engine's queue."""
        self.executor = make_executor(self.od_config)
        self.shape_rule = _with_budget(rule, od_config, self.executor.worker_info)
        """The sizes the pipeline makes and the memory budget of its requests; the API process checks both
        before queuing, `submit` checks them again, and the scheduler admits by the budget."""
        self._watch(self.executor)
        self._thread = None
        if own_loop:
            self._thread = threading.Thread(target=self._loop, name="DiffusionEngineLoop", daemon=True)
            self._thread.start()
        logger.info(
            "diffusion engine ready: %s (%s, %s output), %d rank(s), %s mode, max_num_seqs=%d, batch wait %.1f ms",
            od_config.model,
            self.model_class_name,
            self.output_modality,
            self.executor.world_size,
            "step" if self.step_execution else "request",
            od_config.max_num_seqs,
            od_config.request_batch_max_wait_ms,
        )

    # ---- public API ----------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead

    @property
    def is_restarting(self) -> bool:
        """A worker died and new workers are starting: the stage is degraded, not dead."""
        return self._restarting

    def submit(
        self, request: OmniDiffusionRequest, on_partial: Callable[[PartialResult], None] | None = None
    ) -> Future[DiffusionOutput]:
        """Queue a request; invalid input raises `OmniClientError` here, before anything is queued.

        `on_partial` must return quickly (hand the item to a queue): it runs on the thread that reads the
        workers' results, so a slow callback delays every request's results (never the workers).
        """
        request = _validated(request)
        if self.shape_rule is not None:
            self.shape_rule.check(request.sampling_params)
        future: Future[DiffusionOutput] = Future()
        with self._lock:
            if self._stopping:
                raise EngineDeadError("the diffusion engine is closed")
            if self.is_dead:
                raise EngineDeadError()
            rid = request.request_id
            if rid in self._waiting or rid in self._running:
                raise OmniClientError(f"request_id {rid!r} is already in flight", param="request_id")
            self.scheduler.add(request, stream=on_partial is not None)
            self._waiting[rid] = (future, time.perf_counter())
            if on_partial is not None:
                self._partial_callbacks[rid] = on_partial
        self._wake()
        return future

    def abort(self, request_ids: list[str]) -> None:
        """Drop queued requests and stop running ones; their futures are cancelled at once, and the workers
        leave the aborted rows of their forward at the next step (`num_running` counts them until then)."""
        with self._lock:
            for rid in request_ids:
                self._partial_callbacks.pop(rid, None)
            for job in self.scheduler.abort(request_ids):
                self._waiting.pop(job.request_id)[0].cancel()
                self._counters["num_aborted"] += 1
            running = [rid for rid in request_ids if rid in self._running]
            for rid in running:
                if self._running[rid].cancel():
                    self._counters["num_aborted"] += 1
            executor = self.executor
        if running and self.scheduler.whole_requests:  # request mode: the workers stop them inside the batch
            executor.abort(running)
        self._wake()  # step mode: the next round drops them

    def when_stopped(self, request_ids: list[str]) -> Future[None]:
        """A future that resolves once none of these requests runs on the workers (an aborted one leaves at its
        next denoise step); resolved on the loop, at once when none runs now."""
        future: Future[None] = Future()
        with self._lock:
            running = {rid for rid in request_ids if rid in self._running}
            if running:
                self._stop_waits.append((running, future))
                return future
        future.set_result(None)
        return future

    def wait_stopped(self, request_ids: list[str], timeout: float) -> bool:
        """Block until none of these requests runs on the workers; False when some still ran after `timeout`
        seconds. For in-process callers (the engine's own thread drives the loop)."""
        future = self.when_stopped(request_ids)
        try:
            future.result(timeout)
        except TimeoutError:
            future.cancel()
            return False
        return True

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        """The executor's (`non_block`: a future the loop resolves)."""
        return self.executor.collective_rpc(method, args=args, kwargs=kwargs, timeout=timeout, non_block=non_block)

    def register_failure_callback(self, fn: Callable[[], None]) -> None:
        self._failure_callbacks.append(fn)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "num_forwards": self._counters["num_forwards"],
                "num_requests_finished": self._counters["num_finished"],
                "num_requests_failed": self._counters["num_failed"],
                "num_aborted": self._counters["num_aborted"],
                "num_refused": self.scheduler.num_refused,
                "batch_sizes": dict(self._batch_sizes),
                "num_running": len(self._running),
                "num_waiting": self.scheduler.num_waiting,
                "memory_reserved_bytes": sum(self._reserved.values()),
                "memory_budget_bytes": self._budget,
                "num_restarts": self._restarts,
                "is_restarting": self._restarting,
                "is_dead": self.is_dead,
            }

    def begin_shutdown(self) -> None:
        """The owner is stopping (it was signalled, and so may the workers have been): a worker that exits from now
        on is not restarted. Sets one flag and takes no lock, so a signal handler may call it; `close` follows."""
        self._shutting_down = True

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Stop the workers and release every resource; always returns within about `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(min(_LOOP_JOIN_TIMEOUT_S, max(deadline - time.monotonic(), 0.0)))
        if self._restart_thread is not None:
            self._restart_thread.join(max(deadline - time.monotonic() - 1.0, 0.0))
        if isinstance(self._replacement, MultiprocDiffusionExecutor):  # built but never swapped in
            self._replacement.shutdown(timeout=max(deadline - time.monotonic(), 1.0))
        self.executor.shutdown(timeout=max(deadline - time.monotonic(), 1.0))
        self._fail_waiting(EngineDeadError("the diffusion engine was closed"))
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ---- scheduling ----------------------------------------------------------------------------------

    def run_once(self, extra: tuple[zmq.Socket, ...] = (), max_wait_s: float = _IDLE_WAIT_S) -> list[zmq.Socket]:
        """One pass of the loop: finish the round whose result came, schedule and send the next, then wait (up to
        what the scheduler has due, at most `max_wait_s`) for the workers, a wake-up or the `extra` sockets, and
        dispatch what the workers sent. Returns the `extra` sockets that are ready."""
        try:
            wait = self._advance()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("the diffusion engine loop crashed")
            self._give_up(f"the diffusion engine loop crashed: {exc}")  # no restart: the scheduler state is gone
            self.executor.fail(f"the diffusion engine loop crashed: {exc}")
            wait = max_wait_s
        return self._poll(min(wait, max_wait_s), extra)

    def _loop(self) -> None:
        while not (self._stopping or self._dead):
            self.run_once()

    def _wake(self) -> None:
        """Interrupt the loop's wait (a request came, an abort, new workers)."""
        with contextlib.suppress(OSError):  # full: the loop wakes anyway; closed: the engine is closed
            self._wake_w.send(b"\0")

    def _poll(self, timeout_s: float, extra: tuple[zmq.Socket, ...]) -> list[zmq.Socket]:
        executor = self.executor
        if self._poller is None or self._poller[0] is not executor or self._poller[1] != extra:
            poller = zmq.Poller()
            for item in [*extra, self._wake_r.fileno(), *executor.result_sockets, *executor.sentinels]:
                poller.register(item, zmq.POLLIN)
            self._poller = executor, extra, poller
        poller = self._poller[2]
        if executor.is_failed:  # nothing more to read from it; new workers replace it
            poller = zmq.Poller()
            for item in [*extra, self._wake_r.fileno()]:
                poller.register(item, zmq.POLLIN)
        events = dict(poller.poll(max(int(timeout_s * 1000), 0)))
        if self._wake_r.fileno() in events:  # zmq's poller reports a plain fd by its number
            with contextlib.suppress(BlockingIOError):
                while self._wake_r.recv(4096):
                    pass
        if not executor.is_failed:
            executor.process_results()
            if any(sentinel in events for sentinel in executor.sentinels):
                executor.check_workers()
        return [sock for sock in extra if sock in events]

    def _advance(self) -> float:
        """Finish the round in flight once its result came; then schedule and send the next. Returns how long the
        loop may wait for an event before this needs to run again."""
        self._swap_in_new_workers()
        if self._round is not None:
            plan, future = self._round
            if not future.done():
                return _IDLE_WAIT_S
            self._round = None
            try:
                result = self._result(plan, future)
            except EngineDeadError as exc:
                self._fail_on_workers(exc)
            else:
                self._finish_round(plan, result)
        with self._lock:
            if self._ending or self._dead or self._restarting or self.executor.is_failed:
                return _IDLE_WAIT_S
            if not self.scheduler.has_work:
                return _IDLE_WAIT_S
            plan = self.scheduler.schedule(fits=self._fits)
            if not (plan.step or plan.abort):  # nothing fits yet, or a batch waits for company
                return self.scheduler.due or _IDLE_WAIT_S
            now = time.perf_counter()
            for request in plan.new:
                future, arrival = self._waiting.pop(request.request_id)
                self._running[request.request_id] = future
                self._queued[request.request_id] = now - arrival
                if self.shape_rule is not None:
                    self._reserved[request.request_id] = self.shape_rule.estimate_bytes(request.sampling_params)
            if plan.new:
                batches = [len(plan.new)] if self.scheduler.whole_requests else [1] * len(plan.new)
                self._batch_sizes.update(batches)
                self._counters["num_forwards"] += len(batches)
            executor = self.executor
        try:
            future = self._execute(executor, plan)
        except EngineDeadError as exc:
            self._fail_on_workers(exc)
            return 0.0
        self._round = plan, future
        return 0.0 if future.done() else _IDLE_WAIT_S

    def _execute(self, executor: MultiprocDiffusionExecutor, plan: StepPlan) -> Future:
        """Send the plan to the workers: step mode one round, request mode its batch's whole requests."""
        if not self.scheduler.whole_requests:
            return executor.execute_plan(plan, self._on_partial)
        try:
            future = executor.execute_batch(plan.new, plan.stream, self._on_partial if plan.stream else None)
        except EngineDeadError:
            raise
        except Exception as exc:  # e.g. the batch could not be sent: its requests fail, the engine goes on
            future = Future()
            future.set_result([DiffusionOutput.from_exception(exc) for _ in plan.step])
            return future
        with self._lock:  # aborted between leaving the queue and reaching the executor: tell the workers now
            aborted = [rid for rid in plan.step if rid in self._running and self._running[rid].cancelled()]
        if aborted:
            executor.abort(aborted)
        return future

    def _result(self, plan: StepPlan, future: Future) -> StepResult:
        """The round's `StepResult` (request mode: the batch's outputs by request id); raises `EngineDeadError`."""
        result = future.result()
        if isinstance(result, StepResult):
            return result
        return StepResult(plan.round_id, 0, outputs=dict(zip(plan.step, result, strict=True)))

    def _finish_round(self, plan: StepPlan, result: StepResult) -> None:
        for rid in [*plan.step, *plan.abort]:  # a request the workers do not account for must not wait forever
            if rid not in result.outputs and rid not in result.progress:
                result.outputs[rid] = DiffusionOutput.from_exception(
                    RuntimeError(f"the diffusion workers lost request {rid} (round {plan.round_id})")
                )
        resolved = []
        with self._lock:
            for job, output in self.scheduler.update(plan, result):
                rid = job.request_id
                future = self._running.pop(rid, None)
                self._reserved.pop(rid, None)
                self._partial_callbacks.pop(rid, None)
                output.stage_durations["queue"] = self._queued.pop(rid, 0.0)
                if future is not None and not future.cancelled():
                    self._counters["num_failed" if output.error else "num_finished"] += 1
                    resolved.append((future, output))
            for _, output in resolved:
                if output.step_stats is not None:
                    output.step_stats.reserved_bytes = sum(self._reserved.values())
                    output.step_stats.budget_bytes = self._budget
            stopped = self._pop_stopped()
        for future, output in resolved:
            _set(future, result=output)
        for future in stopped:
            _set(future)

    def _fail_on_workers(self, exc: EngineDeadError) -> None:
        """The workers died mid-round: their requests fail (503 while the stage restarts); waiting ones stay."""
        if self._restarting or self._can_restart():  # the failure callback may have started the restart already
            exc = StageRestartingError(f"{exc}; the diffusion stage is restarting its workers")
        failed = []
        with self._lock:
            for job in self.scheduler.forget_workers():
                rid = job.request_id
                future = self._running.pop(rid, None)
                self._reserved.pop(rid, None)
                self._partial_callbacks.pop(rid, None)
                self._queued.pop(rid, None)
                if future is not None and not future.cancelled():
                    self._counters["num_failed"] += 1
                    failed.append(future)
            stopped = self._pop_stopped()
        for future in failed:
            _set(future, exception=exc)
        for future in stopped:
            _set(future)

    def _pop_stopped(self) -> list[Future[None]]:
        """Under the lock, after requests left `_running`: the `when_stopped` futures none of whose requests runs
        any more (resolved by the caller once the lock is released)."""
        stopped, waits = [], []
        for running, future in self._stop_waits:
            running.intersection_update(self._running)
            if future.cancelled():  # its waiter gave up
                continue
            if running:
                waits.append((running, future))
            else:
                stopped.append(future)
        self._stop_waits = waits
        return stopped

    @property
    def _budget(self) -> int | None:
        return None if self.shape_rule is None else self.shape_rule.memory_budget_bytes

    def _fits(self, requests: list[OmniDiffusionRequest]) -> bool:
        """Memory admission (called under the lock): what runs plus these requests' estimates fit the budget.
        A lone request on idle workers always fits: `submit` refused the ones that never could."""
        budget = self._budget
        if budget is None or (not self._reserved and len(requests) == 1):
            return True
        need = sum(self.shape_rule.estimate_bytes(r.sampling_params) for r in requests)
        return sum(self._reserved.values()) + need <= budget

    def _on_partial(self, partial: PartialResult) -> None:
        """Under the lock, so that no partial reaches a request's callback once `abort` returned."""
        with self._lock:
            callback = self._partial_callbacks.get(partial.request_id)
            if callback is not None:
                callback(partial)

    # ---- worker death and restart -------------------------------------------------------------------

    def _can_restart(self) -> bool:
        return not (self._ending or self._dead) and self._restarts < self.od_config.max_stage_restarts

    @property
    def _ending(self) -> bool:
        """Closing, or about to: a worker's exit is part of the shutdown, not a failure to recover from."""
        return self._stopping or self._shutting_down

    def _watch(self, executor: MultiprocDiffusionExecutor) -> None:
        executor.register_failure_callback(lambda: self._on_executor_failure(executor))
        if executor.is_failed:  # died before the callback was registered
            self._on_executor_failure(executor)

    def _on_executor_failure(self, executor: MultiprocDiffusionExecutor) -> None:
        """Runs where the executor failed (the loop, or a utility call that found a worker gone)."""
        with self._lock:
            if self._ending:
                logger.info("a diffusion worker exited while the engine stops; not restarting it")
                return
            if self._dead or self._restarting or executor is not self.executor:
                return
            restart = self._can_restart()
            if restart:
                self._restarts += 1
                self._restarting = True
                self._restart_thread = threading.Thread(
                    target=self._restart, args=(executor,), name="DiffusionRestart", daemon=True
                )
                self._restart_thread.start()
        if not restart:
            self._give_up("a diffusion worker died; the engine is dead")

    def _restart(self, failed: MultiprocDiffusionExecutor) -> None:
        """Off the loop (loading takes long): new workers once the old ones are gone; the loop swaps them in."""
        failed.stop_workers()  # their device memory is free before the new ones load
        grace_end = time.monotonic() + _RESTART_GRACE_S
        while not self._ending and time.monotonic() < grace_end:  # a flag, not an Event: a signal handler sets it
            time.sleep(0.02)
        if self._ending:  # stopped meanwhile: no new workers
            logger.info("a diffusion worker exited as the engine stops; not restarting it")
            return
        logger.warning(
            "restarting the diffusion workers (restart %d of at most %d)",
            self._restarts,
            self.od_config.max_stage_restarts,
        )
        try:
            replacement: MultiprocDiffusionExecutor | BaseException = make_executor(self.od_config)
        except Exception as exc:
            logger.exception("restarting the diffusion workers failed")
            replacement = exc
        with self._lock:
            self._replacement = replacement
        self._wake()

    def _swap_in_new_workers(self) -> None:
        """On the loop: the failed executor (whose sockets only the loop touches) goes, its replacement comes."""
        with self._lock:
            replacement, self._replacement = self._replacement, None
            if replacement is None or self._ending:
                self._replacement = replacement  # close() shuts a built one down
                return
        self.executor.shutdown()
        if isinstance(replacement, BaseException):
            with self._lock:
                self._restarting = False
            self._give_up(f"a diffusion worker died and restarting the workers failed: {replacement}")
            return
        with self._lock:
            self.executor = replacement
            self._restarting = False
        logger.info("diffusion workers restarted")
        self._watch(replacement)

    def _give_up(self, reason: str) -> None:
        with self._lock:
            self._dead = True
        self._fail_waiting(EngineDeadError(reason))
        for fn in self._failure_callbacks:
            try:
                fn()
            except Exception:
                logger.exception("diffusion engine failure callback raised")

    def _fail_waiting(self, error: EngineDeadError) -> None:
        with self._lock:
            waiting = [future for future, _ in self._waiting.values()]
            self._waiting.clear()
            self._partial_callbacks.clear()
            self.scheduler.drain()  # the scheduler thread no longer resolves what ran on the workers
            waiting += self._running.values()
            self._running.clear()
            self._reserved.clear()
            stopped = self._pop_stopped()
        for future in waiting:
            _set(future, exception=error)
        for future in stopped:
            _set(future)


def _with_budget(
    rule: ShapeRule | None, od_config: OmniDiffusionConfig, worker_info: list[dict[str, Any]]
) -> ShapeRule | None:
    """The family's rule with this stage's activation width and memory budget: the configured GiB, else the
    least free device memory any rank measured after loading (CUDA), else none (CPU); and the peaks the ranks
    measured at warm-up, the largest rank's per size (CUDA)."""
    if rule is None:
        return None
    peaks: dict[tuple[int, int], int] = {}
    steps = rule.measured_steps
    for info in worker_info:
        for peak in info.get("measured_peaks", []):
            height, width = rule.default_size if peak["size"] is None else peak["size"][::-1]
            peaks[height, width] = max(peaks.get((height, width), 0), peak["bytes"])
            steps = peak["steps"]
    on_cuda = any("cuda" in str(info.get("device", "")) for info in worker_info)
    dtype = od_config.dtype if od_config.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    budget = None
    if od_config.diffusion_memory_budget_gb is not None:
        budget = int(od_config.diffusion_memory_budget_gb * 2**30)
    elif free := [info["free_memory_bytes"] for info in worker_info if "free_memory_bytes" in info]:
        budget = min(free)
    return dataclasses.replace(rule, dtype_bytes=4 if dtype == "float32" else 2, memory_budget_bytes=budget,
                               measured_peaks=tuple((h, w, b) for (h, w), b in peaks.items()),
                               measured_steps=steps)


_STEP_MODE_ONLY = ("diffusion_max_tokens_per_forward", "max_paused_states")
_REQUEST_MODE_ONLY = ("request_batch_max_wait_ms",)


def _refuse_inert_flags(od_config: OmniDiffusionConfig, step_execution: bool) -> None:
    """A scheduler setting the stage's mode has no use for is refused, not ignored (its default is fine): a
    request-mode batch runs whole requests (nothing to pause or split), and a step-mode request joins at the next
    step boundary (no batch to wait for). The policy's settings (max_num_seqs, policy, deadlines, starvation
    bound, memory budget) apply to both modes: one scheduler reads them."""
    defaults = {f.name: f.default for f in dataclasses.fields(OmniDiffusionConfig)}
    mode, other = ("step", "request") if step_execution else ("request", "step")
    cannot_step = " (its pipeline cannot step)" if od_config.step_execution and not step_execution else ""
    for name in _REQUEST_MODE_ONLY if step_execution else _STEP_MODE_ONLY:
        if getattr(od_config, name) != defaults[name]:
            raise ValueError(
                f"--{name.replace('_', '-')} applies to {other} mode only; this diffusion stage runs "
                f"in {mode} mode{cannot_step}"
            )


def _validated(request: OmniDiffusionRequest) -> OmniDiffusionRequest:
    if not isinstance(request, OmniDiffusionRequest):
        raise OmniClientError(f"expected an OmniDiffusionRequest, got {type(request).__name__}", param="request")
    if not isinstance(request.request_id, str) or not request.request_id:
        raise OmniClientError("request_id must be a non-empty string", param="request_id")
    prompt = request.prompt
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise OmniClientError(f"prompt must be a string, got {type(text).__name__}", param="prompt")
    if not isinstance(request.sampling_params, OmniDiffusionSamplingParams):
        request.sampling_params = OmniDiffusionSamplingParams.from_params(request.sampling_params)
    negative = request.negative_prompt
    if negative is not None and not isinstance(negative, str):
        raise OmniClientError("negative_prompt must be a string", param="negative_prompt")
    return request


def _set(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve unless the caller cancelled it meanwhile."""
    if future.cancelled():
        return
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled between the check and the set
        pass
