"""The diffusion stage's engine: validates requests, co-batches them, and runs them on the workers.

`submit` is thread-safe and returns a future per request; an optional `on_partial` callback receives the
request's partial results (`PartialResult`: denoise progress, decoded video chunks) on the executor's result
thread, all of them before the future resolves. A scheduler thread forms batches with
`RequestScheduler` and keeps one batch in flight; the batch's results resolve the request futures directly
from the executor's result thread, so a request pays one thread hand-off on the way back. In step mode
(`step_execution`) the same thread runs the rounds of the `StepScheduler` (`core/scheduler.py`): it sends each
round's `StepPlan` to every rank, and rank 0's `StepResult` updates the scheduler and resolves the requests that
left the round.

`abort` resolves the request's future at once and tells the workers, which stop it at the next denoise
step. When a worker dies, the requests it ran fail with `StageRestartingError` (503) and the engine
replaces its executor, up to `max_stage_restarts` times; queued and new requests wait for the new
workers. Past that budget the engine is dead (`EngineDeadError`, failure callbacks fire).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.catalog.resolution import resolve_model_dir, resolve_pipeline_class_name
from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.catalog.spec import import_target
from vllm_omni.diffusion.core.scheduler import StepScheduler
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.executor import make_executor
from vllm_omni.diffusion.executor.multiproc_executor import MultiprocDiffusionExecutor
from vllm_omni.diffusion.interface import supports_request_batch, supports_step_execution
from vllm_omni.diffusion.ipc import PartialResult, StepPlan, StepResult
from vllm_omni.diffusion.model_loader.dummy import check_weights_present
from vllm_omni.diffusion.prompt_bound import PromptBound
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.request_scheduler import RequestScheduler
from vllm_omni.errors import EngineDeadError, OmniClientError, StageRestartingError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

_SCHEDULER_IDLE_WAIT_S = 1.0
_SCHEDULER_JOIN_TIMEOUT_S = 2.0
_CLOSE_TIMEOUT_S = 10.0


class DiffusionEngine:
    def __init__(self, od_config: OmniDiffusionConfig) -> None:
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
            logger.warning("%s cannot step: --step-execution is off for this stage and requests run in request "
                           "mode (docs/execution_modes.md)", pipeline_cls.__name__)
        _refuse_inert_flags(od_config, self.step_execution)
        # Resolved once here: the workers get the checkpoint directory and our class as "module:Class".
        self.od_config = dataclasses.replace(od_config, model=str(model_dir), model_class_name=target,
                                             step_execution=self.step_execution)
        entry = MODEL_REGISTRY.diffusion_entry(self.model_class_name)
        self.prompt_bound = (PromptBound.for_model(model_dir, entry.prompt_tokenizer, entry.max_prompt_tokens)
                             if entry is not None and entry.max_prompt_tokens else None)
        """The text encoder's token limit, checked by the stage client off the event loop before `submit`."""
        rule = import_target(entry.shape_rule)(model_dir) if entry is not None and entry.shape_rule else None
        self.supports_request_batch = supports_request_batch(pipeline_cls)
        if od_config.max_num_seqs > 1 and not (self.supports_request_batch or self.step_execution):
            raise ValueError(
                f"{pipeline_cls.__name__} (serving {self.model_class_name}) does not support request-level "
                f"batching. Use max_num_seqs=1 (got {od_config.max_num_seqs})."
            )
        self.scheduler = None if self.step_execution else RequestScheduler(
            od_config.max_num_seqs, od_config.request_batch_max_wait_ms, od_config.diffusion_scheduler_policy,
            od_config.default_deadline_ms)
        self.steps = StepScheduler(self.od_config) if self.step_execution else None
        """Step mode's scheduler (request mode's is `scheduler`)."""
        self._cond = threading.Condition()
        self._waiting: dict[str, tuple[Future[DiffusionOutput], float]] = {}
        self._running: dict[str, Future[DiffusionOutput]] = {}
        self._partial_callbacks: dict[str, Callable[[PartialResult], None]] = {}
        self._batch_in_flight = False
        self._stopping = False
        self._dead = False
        self._restarting = False
        self._restarts = 0
        self._restart_thread: threading.Thread | None = None
        self._counters: Counter[str] = Counter()
        self._batch_sizes: Counter[int] = Counter()
        self._failure_callbacks: list[Callable[[], None]] = []
        self._reserved: dict[str, int] = {}
        """Estimated bytes of each request on the workers (memory admission)."""
        self._queued: dict[str, float] = {}
        """Step mode: seconds each request on the workers waited in the engine's queue."""
        self.executor = make_executor(self.od_config)
        self.shape_rule = _with_budget(rule, od_config, self.executor.worker_info)
        """The sizes the pipeline makes and the memory budget of its requests; the API process checks both
        before queuing, `submit` checks them again, and the scheduler admits by the budget."""
        self._watch(self.executor)
        self._thread = threading.Thread(target=self._schedule_loop, name="DiffusionScheduler", daemon=True)
        self._thread.start()
        logger.info(
            "diffusion engine ready: %s (%s, %s output), %d rank(s), %s mode, max_num_seqs=%d, batch wait %.1f ms",
            od_config.model, self.model_class_name, self.output_modality, self.executor.world_size,
            "step" if self.step_execution else "request", od_config.max_num_seqs, od_config.request_batch_max_wait_ms,
        )

    # ---- public API ----------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead

    @property
    def is_restarting(self) -> bool:
        """A worker died and new workers are starting: the stage is degraded, not dead."""
        return self._restarting

    def submit(self, request: OmniDiffusionRequest, on_partial: Callable[[PartialResult], None] | None = None
               ) -> Future[DiffusionOutput]:
        """Queue a request; invalid input raises `OmniClientError` here, before anything is queued.

        `on_partial` must return quickly (hand the item to a queue): it runs on the thread that reads the
        workers' results, so a slow callback delays every request's results (never the workers).
        """
        request = _validated(request)
        if self.shape_rule is not None:
            self.shape_rule.check(request.sampling_params)
        future: Future[DiffusionOutput] = Future()
        with self._cond:
            if self._stopping:
                raise EngineDeadError("the diffusion engine is closed")
            if self.is_dead:
                raise EngineDeadError()
            rid = request.request_id
            if rid in self._waiting or rid in self._running:
                raise OmniClientError(f"request_id {rid!r} is already in flight", param="request_id")
            if self.steps is not None:
                self.steps.add(request, stream=on_partial is not None)
            else:
                self.scheduler.add_request(request)
            self._waiting[rid] = (future, time.perf_counter())
            if on_partial is not None:
                self._partial_callbacks[rid] = on_partial
            self._cond.notify()
        return future

    def abort(self, request_ids: list[str]) -> None:
        """Drop queued requests and stop running ones; their futures are cancelled at once, and the workers
        leave the aborted rows of their forward at the next step (`num_running` counts them until then)."""
        with self._cond:
            for rid in request_ids:
                self._partial_callbacks.pop(rid, None)
            dropped = (self.scheduler.abort(request_ids) if self.steps is None
                       else [job.request for job in self.steps.abort(request_ids)])
            for request in dropped:
                self._waiting.pop(request.request_id)[0].cancel()
                self._counters["num_aborted"] += 1
            running = [rid for rid in request_ids if rid in self._running]
            for rid in running:
                if self._running[rid].cancel():
                    self._counters["num_aborted"] += 1
            executor = self.executor
            self._cond.notify_all()  # step mode: the next round drops them
        if running and self.steps is None:
            executor.abort(running)

    def wait_stopped(self, request_ids: list[str], timeout: float) -> bool:
        """Wait until none of these requests runs on the workers (an aborted one leaves at its next denoise
        step); False when some still ran after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(rid in self._running for rid in request_ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        return self.executor.collective_rpc(method, args=args, kwargs=kwargs, timeout=timeout)

    def register_failure_callback(self, fn: Callable[[], None]) -> None:
        self._failure_callbacks.append(fn)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "num_forwards": self._counters["num_forwards"],
                "num_requests_finished": self._counters["num_finished"],
                "num_requests_failed": self._counters["num_failed"],
                "num_aborted": self._counters["num_aborted"],
                "batch_sizes": dict(self._batch_sizes),
                "num_running": len(self._running),
                "num_waiting": (self.steps or self.scheduler).num_waiting,
                "num_restarts": self._restarts,
                "is_restarting": self._restarting,
                "is_dead": self.is_dead,
            }

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Stop the workers and release every resource; always returns within about `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(min(_SCHEDULER_JOIN_TIMEOUT_S, max(deadline - time.monotonic(), 0.0)))
        if self._restart_thread is not None:  # it shuts down what it starts once it sees _stopping
            self._restart_thread.join(max(deadline - time.monotonic() - 1.0, 0.0))
        self.executor.shutdown(timeout=max(deadline - time.monotonic(), 1.0))
        self._fail_waiting(EngineDeadError("the diffusion engine was closed"))

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ---- scheduling ----------------------------------------------------------------------------------

    def _schedule_loop(self) -> None:
        try:
            if self.steps is not None:
                self._step_forever()
            else:
                self._schedule_forever()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("diffusion scheduler thread crashed")
            self._give_up(f"diffusion scheduler thread crashed: {exc}")  # no restart: the scheduler is gone
            self.executor.fail(f"diffusion scheduler thread crashed: {exc}")

    def _schedule_forever(self) -> None:
        while True:
            with self._cond:
                batch: list[OmniDiffusionRequest] = []
                while not batch:
                    if self._stopping or self._dead:
                        return
                    wait = _SCHEDULER_IDLE_WAIT_S
                    if not self._batch_in_flight and not self._restarting:
                        batch, due = self.scheduler.schedule(fits=self._fits)
                        wait = due if due is not None else wait
                    if not batch:
                        self._cond.wait(wait)
                now = time.perf_counter()
                futures = {}
                for request in batch:
                    future, arrival = self._waiting.pop(request.request_id)
                    futures[request.request_id] = (future, now - arrival)
                    self._running[request.request_id] = future
                    if self.shape_rule is not None:
                        self._reserved[request.request_id] = self.shape_rule.estimate_bytes(request.sampling_params)
                self._batch_in_flight = True
                self._batch_sizes[len(batch)] += 1
                self._counters["num_forwards"] += 1
                executor = self.executor
            streamed = [r.request_id for r in batch if r.request_id in self._partial_callbacks]
            try:
                batch_future = executor.execute_batch(batch, streamed, self._on_partial if streamed else None)
            except Exception as exc:
                batch_future = Future()
                batch_future.set_exception(exc)
            else:  # aborted between leaving the queue and reaching the executor: tell the workers now
                if aborted := [rid for rid, (future, _) in futures.items() if future.cancelled()]:
                    executor.abort(aborted)
            batch_future.add_done_callback(lambda f, futures=futures: self._finish_batch(f, futures))

    def _step_forever(self) -> None:
        """Step mode: one round in flight; schedule, the workers execute the plan, update, until stopped."""
        while True:
            with self._cond:
                plan = None
                while plan is None:
                    if self._stopping or self._dead:
                        return
                    if not (self._restarting or self.executor.is_failed) and self.steps.has_work:
                        plan = self.steps.schedule(fits=self._fits)
                        if not (plan.step or plan.abort):  # nothing fits yet: wait for memory to free
                            plan = None
                    if plan is None:
                        self._cond.wait(_SCHEDULER_IDLE_WAIT_S)
                now = time.perf_counter()
                for request in plan.new:
                    future, arrival = self._waiting.pop(request.request_id)
                    self._running[request.request_id] = future
                    self._queued[request.request_id] = now - arrival
                    if self.shape_rule is not None:
                        self._reserved[request.request_id] = self.shape_rule.estimate_bytes(request.sampling_params)
                    self._batch_sizes[1] += 1
                    self._counters["num_forwards"] += 1
                executor = self.executor
            try:
                result = self._await_round(executor.execute_plan(plan, self._on_partial))
            except EngineDeadError as exc:
                self._fail_on_workers(exc)
                continue
            if result is None:
                return
            self._finish_round(plan, result)

    def _await_round(self, future: Future[StepResult]) -> StepResult | None:
        """The round's result; None once the engine is closing (close fails what ran)."""
        while True:
            try:
                return future.result(timeout=_SCHEDULER_IDLE_WAIT_S)
            except TimeoutError:
                if self._stopping:
                    return None

    def _finish_round(self, plan: StepPlan, result: StepResult) -> None:
        for rid in [*plan.step, *plan.abort]:  # a request the workers do not account for must not wait forever
            if rid not in result.outputs and rid not in result.progress:
                result.outputs[rid] = DiffusionOutput.from_exception(
                    RuntimeError(f"the diffusion workers lost request {rid} (round {plan.round_id})"))
        resolved = []
        with self._cond:
            for job, output in self.steps.update(plan, result):
                rid = job.request_id
                future = self._running.pop(rid, None)
                self._reserved.pop(rid, None)
                self._partial_callbacks.pop(rid, None)
                output.stage_durations["queue"] = self._queued.pop(rid, 0.0)
                if future is not None and not future.cancelled():
                    self._counters["num_failed" if output.error else "num_finished"] += 1
                    resolved.append((future, output))
            self._cond.notify_all()  # `wait_stopped` callers
        for future, output in resolved:
            _set(future, result=output)

    def _fail_on_workers(self, exc: EngineDeadError) -> None:
        """The workers died mid-round: their requests fail (503 while the stage restarts); waiting ones stay."""
        if self._can_restart():
            exc = StageRestartingError(f"{exc}; the diffusion stage is restarting its workers")
        failed = []
        with self._cond:
            for job in self.steps.forget_workers():
                rid = job.request_id
                future = self._running.pop(rid, None)
                self._reserved.pop(rid, None)
                self._partial_callbacks.pop(rid, None)
                self._queued.pop(rid, None)
                if future is not None and not future.cancelled():
                    self._counters["num_failed"] += 1
                    failed.append(future)
            self._cond.notify_all()
        for future in failed:
            _set(future, exception=exc)

    def _fits(self, requests: list[OmniDiffusionRequest]) -> bool:
        """Memory admission (called under the lock): what runs plus these requests' estimates fit the budget.
        A lone request on idle workers always fits: `submit` refused the ones that never could."""
        budget = None if self.shape_rule is None else self.shape_rule.memory_budget_bytes
        if budget is None or (not self._reserved and len(requests) == 1):
            return True
        need = sum(self.shape_rule.estimate_bytes(r.sampling_params) for r in requests)
        return sum(self._reserved.values()) + need <= budget

    def _on_partial(self, partial: PartialResult) -> None:
        callback = self._partial_callbacks.get(partial.request_id)
        if callback is not None:
            callback(partial)

    def _finish_batch(
        self, batch_future: Future[list[DiffusionOutput]], futures: dict[str, tuple[Future, float]]
    ) -> None:
        """Runs on the executor's result thread (or wherever the batch future completed)."""
        exc = batch_future.exception()
        outputs = batch_future.result() if exc is None else None
        if isinstance(exc, EngineDeadError) and self._can_restart():
            exc = StageRestartingError(f"{exc}; the diffusion stage is restarting its workers")
        with self._cond:
            for rid in futures:
                self._running.pop(rid, None)
                self._reserved.pop(rid, None)
                self._partial_callbacks.pop(rid, None)
            self._batch_in_flight = False
            self._cond.notify_all()  # the scheduler, and `wait_stopped` callers
        for i, (future, queued) in enumerate(futures.values()):
            if future.cancelled():
                continue
            if isinstance(exc, EngineDeadError | StageRestartingError):
                with self._cond:
                    self._counters["num_failed"] += 1
                _set(future, exception=exc)
                continue
            if exc is not None:  # e.g. the batch could not be sent: its requests fail, the engine goes on
                _set(future, result=DiffusionOutput.from_exception(exc))
                continue
            output = outputs[i]
            output.stage_durations["queue"] = queued
            with self._cond:
                self._counters["num_failed" if output.error else "num_finished"] += 1
            _set(future, result=output)

    # ---- worker death and restart -------------------------------------------------------------------

    def _can_restart(self) -> bool:
        return not (self._stopping or self._dead) and self._restarts < self.od_config.max_stage_restarts

    def _watch(self, executor: MultiprocDiffusionExecutor) -> None:
        executor.register_failure_callback(lambda: self._on_executor_failure(executor))
        if executor.is_failed:  # died before the callback was registered
            self._on_executor_failure(executor)

    def _on_executor_failure(self, executor: MultiprocDiffusionExecutor) -> None:
        """Runs on the executor's monitor thread once its in-flight batch has failed."""
        with self._cond:
            if self._stopping or self._dead or self._restarting or executor is not self.executor:
                return
            restart = self._can_restart()
            if restart:
                self._restarts += 1
                self._restarting = True
                self._restart_thread = threading.Thread(target=self._restart, args=(executor,),
                                                        name="DiffusionRestart", daemon=True)
                self._restart_thread.start()
        if not restart:
            self._give_up("a diffusion worker died; the engine is dead")

    def _restart(self, failed: MultiprocDiffusionExecutor) -> None:
        logger.warning("restarting the diffusion workers (restart %d of at most %d)", self._restarts,
                       self.od_config.max_stage_restarts)
        failed.shutdown()
        try:
            executor = make_executor(self.od_config)
        except Exception as exc:
            logger.exception("restarting the diffusion workers failed")
            with self._cond:
                self._restarting = False
            self._give_up(f"a diffusion worker died and restarting the workers failed: {exc}")
            return
        with self._cond:
            stopping = self._stopping
            if not stopping:
                self.executor = executor
                self._restarting = False
                self._cond.notify_all()
        if stopping:
            executor.shutdown()
            return
        logger.info("diffusion workers restarted")
        self._watch(executor)

    def _give_up(self, reason: str) -> None:
        with self._cond:
            self._dead = True
        self._fail_waiting(EngineDeadError(reason))
        for fn in self._failure_callbacks:
            try:
                fn()
            except Exception:
                logger.exception("diffusion engine failure callback raised")

    def _fail_waiting(self, error: EngineDeadError) -> None:
        with self._cond:
            waiting = [future for future, _ in self._waiting.values()]
            self._waiting.clear()
            self._partial_callbacks.clear()
            if self.steps is not None:  # the step thread no longer resolves what ran on the workers
                self.steps.drain()
                waiting += self._running.values()
                self._running.clear()
                self._reserved.clear()
            else:
                self.scheduler.drain()
            self._cond.notify_all()
        for future in waiting:
            _set(future, exception=error)


def _with_budget(rule: ShapeRule | None, od_config: OmniDiffusionConfig, worker_info: list[dict[str, Any]]
                 ) -> ShapeRule | None:
    """The family's rule with this stage's activation width and memory budget: the configured GiB, else the
    least free device memory any rank measured after loading (CUDA), else none (CPU)."""
    if rule is None:
        return None
    on_cuda = any("cuda" in str(info.get("device", "")) for info in worker_info)
    dtype = od_config.dtype if od_config.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    budget = None
    if od_config.diffusion_memory_budget_gb is not None:
        budget = int(od_config.diffusion_memory_budget_gb * 2**30)
    elif free := [info["free_memory_bytes"] for info in worker_info if "free_memory_bytes" in info]:
        budget = min(free)
    return dataclasses.replace(rule, dtype_bytes=4 if dtype == "float32" else 2, memory_budget_bytes=budget)


_STEP_MODE_ONLY = ("diffusion_max_tokens_per_forward", "slo_starvation_factor", "slo_deadline_factor",
                   "max_paused_states")
_REQUEST_MODE_ONLY = ("request_batch_max_wait_ms",)


def _refuse_inert_flags(od_config: OmniDiffusionConfig, step_execution: bool) -> None:
    """A scheduler setting the stage's mode has no use for is refused, not ignored (its default is fine): a
    request-mode batch runs whole requests (nothing to pause, split or starve), and a step-mode request joins at
    the next step boundary (no batch to wait for)."""
    defaults = {f.name: f.default for f in dataclasses.fields(OmniDiffusionConfig)}
    mode, other = ("step", "request") if step_execution else ("request", "step")
    cannot_step = " (its pipeline cannot step)" if od_config.step_execution and not step_execution else ""
    for name in _REQUEST_MODE_ONLY if step_execution else _STEP_MODE_ONLY:
        if getattr(od_config, name) != defaults[name]:
            raise ValueError(f"--{name.replace('_', '-')} applies to {other} mode only; this diffusion stage runs "
                             f"in {mode} mode{cannot_step}")


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
