"""The diffusion core process, shaped like vLLM's `EngineCoreProc`: the API process talks to it over one socket
pair; it owns the stage's scheduler and executor (`DiffusionEngine`), whose worker processes are its children.

    API process                         diffusion core process (main thread)       worker rank r
    DiffusionCoreClient  --CoreInput-->  busy loop: poll input + worker results   ExecuteBatch / StepPlan
      (caller's loop)    <-CoreOutput--    -> admit / abort -> schedule            -> pipeline
                                           -> execute -> update -> outputs

One thread runs it all (`DiffusionEngine.run_once`, as vLLM's EngineCoreProc busy loop): each pass finishes the
round whose result came and schedules and sends the next, then polls the input socket, the workers' result
sockets and their process sentinels together. A request read from the input is checked (prompt bound, shapes)
and queued, an abort stops it. A utility call is handled in the loop too (as EngineCoreProc's UTILITY requests),
but never waits there: `collective_rpc` sends the call to the workers and its answer is the future the loop
resolves when every rank's result came; an abort's wait is a future the loop resolves when the workers left the
aborted requests. Either answer goes out when its future resolves, or when its deadline passes. Everything the
engine produces for a request (its partials, then its final output or error) goes out on the output socket as it
comes, in order per request. Health changes (restarting its workers, dead) go out as `CoreState`; new workers
load on a restart thread while the loop keeps serving aborts and queueing requests. SIGTERM, or the API process
going away, ends the loop; the engine then stops its workers within its close timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import psutil

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.catalog.spec import ModelSpec
from vllm_omni.diffusion.core.messages import (
    CoreAbort,
    CoreAddRequest,
    CoreError,
    CoreFinal,
    CoreInfo,
    CoreInitFailed,
    CoreInput,
    CorePartial,
    CoreReady,
    CoreState,
    CoreUtility,
    CoreUtilityResult,
)
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.ipc import MsgCodec, PartialResult, cleanup_shm, connect_to_parent
from vllm_omni.errors import OmniClientError, StageRestartingError
from vllm_omni.logger import configure_process_logging, init_logger

logger = init_logger(__name__)

_POLL_MS = 200
"""How often the loop looks at the engine's health and its parent when no input comes."""
_CLOSE_TIMEOUT_S = 10.0
_DEFAULT_RPC_TIMEOUT_S = 600.0


@dataclass
class _PendingCall:
    """A utility call whose answer waits for `future`, at most until `deadline` (then `timed_out()` answers)."""

    future: Future
    deadline: float
    timed_out: Callable[[], Any]


@dataclass
class CoreSpec:
    """What the spawned core needs (pickled once at spawn)."""

    od_config: OmniDiffusionConfig
    input_address: str
    output_address: str
    shm_prefix: str
    """Names of the shared-memory segments the core creates for large outputs (the client unlinks them)."""
    client_shm_prefix: str
    """The client's, for large request payloads (the core unlinks them on receipt)."""
    ipc_dir: str
    """The client's socket directory."""
    families: list[ModelSpec | str]
    """Families the API process registered at run time (`register_family`): registered here too."""
    fork_workers: bool
    """The user chose no start method: the core forks its workers, which then start with the torch and vLLM this
    process imported instead of importing them again in a fresh interpreter (6-12 s of every stage start on CPU)."""


class DiffusionCoreProc:
    def __init__(self, spec: CoreSpec, started_at: float) -> None:
        self.spec = spec
        self.started_at = started_at
        """When the stage asked for this process (its spawn, or its adoption: `prestart.py`)."""
        self.context, self.input, self.output = connect_to_parent(spec.input_address, spec.output_address)
        self.codec = MsgCodec(None, spec.shm_prefix)
        self.decoder = MsgCodec(CoreInput, spec.client_shm_prefix).decoder()
        self._stop = threading.Event()
        self.engine = None
        self._state = CoreState(restarting=False, dead=False)
        self._calls: dict[int, _PendingCall] = {}
        """Utility calls waiting for their future (the workers' answer, the aborted requests leaving)."""

    def start_engine(self) -> bool:
        process_s = time.time() - self.started_at  # the interpreter's start and our imports, if spawned
        start = time.perf_counter()
        from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

        imported = time.perf_counter()
        try:
            self.engine = DiffusionEngine(self.spec.od_config, own_loop=False)
        except BaseException:
            self._send(CoreInitFailed(error=traceback.format_exc()))
            return False
        engine = self.engine
        self._send(
            CoreReady(
                CoreInfo(
                    model_class_name=engine.model_class_name,
                    output_modality=engine.output_modality,
                    input_modalities=sorted(engine.input_modalities),
                    shape_rule=engine.shape_rule,
                    step_execution=engine.step_execution,
                    world_size=engine.executor.world_size,
                    startup_s={
                        "core process": process_s,
                        "core imports": imported - start,
                        **_worker_startup_phases(engine.executor.worker_info),
                    },
                )
            )
        )
        return True

    def run_busy_loop(self) -> bool:
        """schedule -> execute -> poll -> update / admit, until SIGTERM (True) or the API process is gone (False).
        The API process is watched through multiprocessing's parent sentinel, which closes when it dies however
        this process was started (forked from it, or from its forkserver: then it is not our OS parent)."""
        starter = select.poll()  # one poll object: a check per round costs one syscall, like os.getppid()
        parent = multiprocessing.parent_process()
        if parent is not None:
            starter.register(parent.sentinel, select.POLLIN)
        inputs = (self.input,)
        while not self._stop.is_set():
            if self.engine.run_once(inputs, max_wait_s=self._max_wait_s()):
                while self.input.poll(0):
                    self._handle(self.input.recv(copy=False).buffer)
            self._expire_calls()
            self._publish_state()
            if starter.poll(0):  # the sentinel reads EOF
                logger.warning("the API process is gone; the diffusion core stops")
                return False
        return True

    def stop(self, *_: Any) -> None:
        """SIGTERM: end the loop. A process group's SIGTERM (`kill -TERM -PGID`, systemd, docker stop) reaches the
        workers too and may end one before the loop sees it: the engine must not restart it."""
        self._stop.set()
        if self.engine is not None:
            self.engine.begin_shutdown()

    def _handle(self, buffer: memoryview) -> None:
        try:
            msg = self.decoder.decode(buffer)
        except Exception:  # a client bug: nothing to answer to, the core goes on
            logger.exception("undecodable message from the diffusion core client")
            return
        if isinstance(msg, CoreAddRequest):
            self._add(msg)
        elif isinstance(msg, CoreAbort):
            self.engine.abort(msg.request_ids)
            stopped = self.engine.when_stopped(msg.request_ids)
            self._await(msg.call_id, stopped, msg.wait_s, lambda _: True, timed_out=lambda: False)
        elif isinstance(msg, CoreUtility):
            if msg.method == "collective_rpc":
                self._collective_rpc(msg)
            else:
                self._send(
                    CoreUtilityResult(
                        msg.call_id,
                        error=CoreError.of(
                            OmniClientError(f"unknown diffusion core call {msg.method!r}", param="method")
                        ),
                    )
                )

    def _add(self, msg: CoreAddRequest) -> None:
        request = msg.request
        rid = request.request_id
        try:
            if self.engine.prompt_bound is not None:
                self.engine.prompt_bound.check(
                    {"prompt": request.prompt_text, "negative_prompt": request.negative_prompt}
                )
            future = self.engine.submit(request, on_partial=self._partial if msg.stream else None)
        except Exception as exc:
            self._send(CoreFinal(rid, error=CoreError.of(exc)))
            return
        future.add_done_callback(lambda f, rid=rid: self._final(rid, f))

    def _partial(self, partial: PartialResult) -> None:
        """On the loop, ahead of the request's final output."""
        self._send(CorePartial(partial.request_id, partial.kind, partial.data))

    def _final(self, request_id: str, future: Future[DiffusionOutput]) -> None:
        if future.cancelled():  # aborted: the client already ended the request
            return
        exc = future.exception()
        if isinstance(exc, StageRestartingError):  # the engine marks itself restarting right after this
            self._publish_state(restarting=True)
        self._send(
            CoreFinal(request_id, output=future.result())
            if exc is None
            else CoreFinal(request_id, error=CoreError.of(exc))
        )

    def _collective_rpc(self, msg: CoreUtility) -> None:
        (method,) = msg.args
        timeout = _DEFAULT_RPC_TIMEOUT_S if msg.timeout is None else msg.timeout

        def timed_out() -> Any:
            raise TimeoutError(f"collective_rpc({method!r}) got no answer from every rank within {timeout} s")

        try:
            future = self.engine.collective_rpc(method, **msg.kwargs, non_block=True)
        except Exception as exc:  # the workers are dead or gone
            self._send(CoreUtilityResult(msg.call_id, error=CoreError.of(exc)))
            return
        self._await(msg.call_id, future, timeout, lambda values: values, timed_out)

    def _await(
        self,
        call_id: int,
        future: Future,
        timeout: float,
        value: Callable[[Any], Any],
        timed_out: Callable[[], Any],
    ) -> None:
        """Answer the call with `value(result)` once `future` resolves (on the loop), or with `timed_out()` after
        `timeout` seconds (`_expire_calls`); a raised exception is the call's error."""
        self._calls[call_id] = _PendingCall(future, time.monotonic() + timeout, timed_out)
        future.add_done_callback(lambda f: self._answer(call_id, lambda: value(f.result())))

    def _answer(self, call_id: int, value: Callable[[], Any]) -> None:
        if self._calls.pop(call_id, None) is None:  # answered already (it timed out)
            return
        try:
            self._send(CoreUtilityResult(call_id, value=value()))
        except Exception as exc:
            self._send(CoreUtilityResult(call_id, error=CoreError.of(exc)))

    def _expire_calls(self) -> None:
        now = time.monotonic()
        for call_id, call in [(i, c) for i, c in self._calls.items() if c.deadline <= now]:
            self._answer(call_id, call.timed_out)
            call.future.cancel()  # the engine and the executor forget it

    def _max_wait_s(self) -> float:
        """The loop's longest wait: the poll interval, or less when a call's deadline comes first."""
        wait = _POLL_MS / 1000
        if self._calls:
            wait = min(wait, max(min(c.deadline for c in self._calls.values()) - time.monotonic(), 0.0))
        return wait

    def _publish_state(self, restarting: bool | None = None) -> None:
        """Send the engine's health when it changed; a 503 of a restart goes out after the state it implies."""
        state = CoreState(
            restarting=self.engine.is_restarting if restarting is None else restarting, dead=self.engine.is_dead
        )
        if state != self._state:
            self._state = state
            self._send(state)

    def _send(self, msg: Any) -> None:
        try:
            data = self.codec.encode(msg)
        except Exception as exc:  # e.g. an output the codec cannot carry: its request fails alone
            if not isinstance(msg, CoreFinal | CoreUtilityResult):
                logger.warning("dropped a %s the core cannot encode: %r", type(msg).__name__, exc)
                return
            error = CoreError.of(RuntimeError(f"the diffusion output cannot be sent: {exc!r}"))
            msg = (
                CoreFinal(msg.request_id, error=error)
                if isinstance(msg, CoreFinal)
                else CoreUtilityResult(msg.call_id, error=error)
            )
            data = self.codec.encode(msg)
        self.output.send(data, copy=False)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close(timeout=_CLOSE_TIMEOUT_S)
        self.input.close(linger=0)
        self.output.close()
        self.context.term()


def run_diffusion_core(spec: CoreSpec, adopted_at: float | None = None) -> None:
    """Process entry point: start the engine (its workers), serve until told to stop, stop the workers.
    `adopted_at`: when a prestarted process was handed this spec (`prestart.py`); else it was spawned for it."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if spec.fork_workers:  # before anything here runs a thread: the executor forks only a one-thread process
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    configure_process_logging(spec.od_config.logging_config, f"DiffusionCore_S{spec.od_config.stage_id}")
    for family in spec.families:
        MODEL_REGISTRY.register_family(family)
    proc = DiffusionCoreProc(spec, psutil.Process().create_time() if adopted_at is None else adopted_at)
    signal.signal(signal.SIGTERM, proc.stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop (Ctrl-C reaches us too)
    code = 1
    stopped = True
    try:
        if proc.start_engine():
            stopped = proc.run_busy_loop()
            code = 0 if stopped else 1
    finally:
        if stopped:
            proc.shutdown()
        # else: no goodbye to a dead API process; the workers see us gone and sweep their own resources at once
        # What a client that is gone cannot sweep: its socket files, its requests' and our outputs' segments.
        shutil.rmtree(spec.ipc_dir, ignore_errors=True)
        cleanup_shm(spec.client_shm_prefix)
        cleanup_shm(spec.shm_prefix)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _worker_startup_phases(worker_info: list[dict[str, Any]]) -> dict[str, float]:
    """The slowest rank's seconds per start-up phase."""
    phases: dict[str, float] = {}
    for info in worker_info:
        for name, seconds in info.get("startup_s", {}).items():
            phases[name] = max(phases.get(name, 0.0), seconds)
    return phases
