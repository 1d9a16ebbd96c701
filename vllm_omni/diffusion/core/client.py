"""`DiffusionCoreClient`: the API process's side of one diffusion core process (as vLLM's `AsyncMPClient`).

It starts the core (`core/core.py`: forked before the stage existed, `prestart.py`, or from the forkserver,
`process_start.py`), which starts the stage's workers, and talks to it over one ZeroMQ socket pair with msgspec
messages (`core/messages.py`). Everything here runs on the caller's event loop: the outputs are read by one task
there and handed to the request they belong to, and the core's death is seen through its process sentinel
registered with the loop. No thread of the API process serves the diffusion stage.

`start` may run on a start-up loop that ends afterwards (the engine starts its stages before any caller loop
exists); `on_loop` moves the reading to the loop that drives the client from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import shutil
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator
from multiprocessing.util import Finalize
from typing import Any

import zmq
import zmq.asyncio

from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.diffusion.core.core import CoreSpec, run_diffusion_core
from vllm_omni.diffusion.core.messages import (
    CoreAbort,
    CoreAddRequest,
    CoreFinal,
    CoreInfo,
    CoreInitFailed,
    CoreOutput,
    CorePartial,
    CoreReady,
    CoreState,
    CoreUtility,
    CoreUtilityResult,
)
from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.ipc import MsgCodec, cleanup_shm, new_shm_prefix
from vllm_omni.diffusion.process_start import child_process, start_context, user_chose_no_start_method
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import EngineDeadError, OmniClientError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

_STOP_TIMEOUT_S = 15.0
"""SIGTERM, then the core's own close (abort, stop the workers: 10 s), then kill."""
_DEFAULT_CALL_TIMEOUT_S = 600.0


class RequestStream:
    """One request's partials, then its final message, as the output task hands them over.

    The output task never waits on a reader. While the reader lags, a newer progress report replaces a pending
    older one; video chunks and partial images are never dropped."""

    def __init__(self) -> None:
        self._items: deque[CorePartial] = deque()
        self._wakeup = asyncio.Event()
        self._final: CoreFinal | BaseException | None = None

    def put(self, partial: CorePartial) -> None:
        if partial.kind == "progress" and self._items and self._items[-1].kind == "progress":
            self._items[-1] = partial
        else:
            self._items.append(partial)
        self._wakeup.set()

    def finish(self, final: CoreFinal | BaseException) -> None:
        if self._final is None:
            self._final = final
            self._wakeup.set()

    @property
    def finished(self) -> bool:
        return self._final is not None

    async def partials(self) -> AsyncIterator[CorePartial]:
        """The partials, in order, until the final message arrived."""
        while True:
            while self._items:
                yield self._items.popleft()
            if self._final is not None:
                return
            self._wakeup.clear()
            await self._wakeup.wait()

    async def final(self) -> CoreFinal:
        while self._final is None:
            self._wakeup.clear()
            await self._wakeup.wait()
        if isinstance(self._final, BaseException):
            raise self._final
        return self._final


class DiffusionCoreClient:
    def __init__(self, od_config: OmniDiffusionConfig, prestarted: PrestartedCore | None = None) -> None:
        self.od_config = od_config
        self._prestarted = prestarted
        """A core process forked ahead (`prestart.py`): `launch` hands it the spec instead of spawning one."""
        self.info: CoreInfo | None = None
        self.shm_prefix = new_shm_prefix()
        self._core_shm_prefix = new_shm_prefix()
        self._ipc_dir = tempfile.mkdtemp(prefix="vllm_omni_core_")
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(f"ipc://{self._ipc_dir}/in")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(f"ipc://{self._ipc_dir}/out")
        self._codec = MsgCodec(None, self.shm_prefix)
        self._decoder = MsgCodec(CoreOutput, self._core_shm_prefix).decoder()
        self._requests: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._output_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.restarting = False
        self.dead_reason: str | None = None
        self._closed = False
        self._finalizer: Finalize | None = None

    # ---- life cycle ----------------------------------------------------------------------------------

    async def start(self, timeout: float) -> CoreInfo:
        """Start the core and wait until it and its workers are ready (at most `timeout` seconds)."""
        self.launch()
        return await self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the core process with this process's environment: hand the spec to the prestarted one if it is
        there and alive, else spawn one. The process exists when this returns."""
        spec = CoreSpec(
            od_config=self.od_config,
            input_address=f"ipc://{self._ipc_dir}/in",
            output_address=f"ipc://{self._ipc_dir}/out",
            shm_prefix=self._core_shm_prefix,
            client_shm_prefix=self.shm_prefix,
            ipc_dir=self._ipc_dir,
            families=MODEL_REGISTRY.registered_families(),
            fork_workers=user_chose_no_start_method(),
        )
        name = f"DiffusionCore-{self.od_config.stage_id}"
        prestarted, self._prestarted = self._prestarted, None
        self.proc = prestarted.adopt(spec, name) if prestarted is not None else None
        if self.proc is None:
            # Not a daemon: the core starts the worker processes. Stopped before multiprocessing joins it at exit.
            self.proc = child_process(start_context(), run_diffusion_core, (spec,), name)
            self.proc.start()
        self._finalizer = Finalize(
            self, _stop_core, args=(self.proc, [self.shm_prefix, self._core_shm_prefix], self._ipc_dir), exitpriority=10
        )

    async def wait_ready(self, timeout: float) -> CoreInfo:
        """Wait until the launched core and its workers are ready (at most `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"the diffusion core was not ready after {timeout:.0f} s; raise "
                    "stage_init_timeout if loading the model legitimately takes longer"
                )
            if not await self._output.poll(int(min(remaining, 0.5) * 1000)):
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"the diffusion core (pid {self.proc.pid}) exited with code {self.proc.exitcode} while starting"
                    )
                continue
            msg = self._decoder.decode((await self._output.recv(copy=False)).buffer)
            if isinstance(msg, CoreInitFailed):
                raise RuntimeError(f"the diffusion stage failed to start:\n{msg.error}")
            if isinstance(msg, CoreReady):
                self.info = msg.info
                return msg.info

    def on_loop(self) -> None:
        """Read the core's outputs on this loop from now on, and watch its process here."""
        self._loop = asyncio.get_running_loop()
        self._output_task = self._loop.create_task(self._read_outputs(), name="diffusion-core-outputs")
        self._loop.add_reader(self.proc.sentinel, self._on_core_exit)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def shutdown(self) -> None:
        """Stop the core (it stops its workers) and release everything; callable from any thread, idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(EngineDeadError("the diffusion engine was closed"), on_loop=False)
        if self._finalizer is not None:
            self._finalizer()  # SIGTERM, join, kill; sweep shared memory and socket files
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                loop.call_soon_threadsafe(self._close_on_loop)
                return
        self._ctx.destroy(linger=0)

    def _close_on_loop(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.proc.sentinel)
        if self._output_task is not None:
            self._output_task.cancel()
        self._ctx.destroy(linger=0)

    # ---- requests ------------------------------------------------------------------------------------

    async def add_request(self, request: OmniDiffusionRequest, stream: bool) -> RequestStream:
        """Send a request; its partials (when `stream`) and its final message arrive on the returned stream."""
        self._check_alive()
        rid = request.request_id
        if rid in self._requests:
            raise OmniClientError(f"request_id {rid!r} is already in flight", param="request_id")
        try:
            data = self._codec.encode(CoreAddRequest(request, stream))
        except UnicodeEncodeError as exc:
            raise OmniClientError(f"the request has text that is not valid Unicode: {exc}", param="prompt") from exc
        self._requests[rid] = stream_ = RequestStream()
        await self._input.send(data, copy=False)
        return stream_

    def release(self, request_id: str) -> None:
        """The caller stopped reading this request (finished or aborted)."""
        self._requests.pop(request_id, None)

    async def abort(self, request_ids: list[str], wait_s: float) -> bool:
        """Abort these requests; True once the workers left them, False when some still ran after `wait_s`."""
        for rid in request_ids:
            stream = self._requests.pop(rid, None)
            if stream is not None:
                stream.finish(asyncio.CancelledError())
        return await self._call(lambda call_id: CoreAbort(call_id, list(request_ids), wait_s), wait_s + 5.0)

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        wait = _DEFAULT_CALL_TIMEOUT_S if timeout is None else timeout
        return await self._call(
            lambda call_id: CoreUtility(
                call_id, "collective_rpc", [method], {"args": tuple(args), "kwargs": kwargs}, timeout=timeout
            ),
            wait + 5.0,
        )

    async def _call(self, make: Any, timeout: float) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._input.send(self._codec.encode(make(call_id)), copy=False)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the diffusion engine is closed")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    # ---- outputs -------------------------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            frame = await self._output.recv(copy=False)
            try:
                msg = self._decoder.decode(frame.buffer)
            except Exception as exc:  # we cannot tell whose output it was: nobody may wait forever
                logger.exception("undecodable message from the diffusion core")
                self._mark_dead(f"undecodable message from the diffusion core: {exc}")
                return
            if isinstance(msg, CorePartial):
                stream = self._requests.get(msg.request_id)
                if stream is not None:
                    stream.put(msg)
            elif isinstance(msg, CoreFinal):
                stream = self._requests.pop(msg.request_id, None)
                if stream is not None:
                    stream.finish(msg)
            elif isinstance(msg, CoreUtilityResult):
                future = self._calls.pop(msg.call_id, None)
                if future is not None and not future.done():
                    if msg.error is not None:
                        future.set_exception(msg.error.rebuild())
                    else:
                        future.set_result(msg.value)
            elif isinstance(msg, CoreState):
                self.restarting = msg.restarting
                if msg.dead:
                    self._mark_dead("the diffusion stage is dead (its workers died past the restart budget)")

    def _on_core_exit(self) -> None:
        self._loop.remove_reader(self.proc.sentinel)
        self.proc.join(0)
        if not self._closed:
            logger.error("the diffusion core (pid %s) died with exit code %s", self.proc.pid, self.proc.exitcode)
            self._mark_dead(f"the diffusion core process died with exit code {self.proc.exitcode}")
        cleanup_shm(self._core_shm_prefix)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self._fail_all(EngineDeadError(reason), on_loop=True)

    def _fail_all(self, exc: EngineDeadError, on_loop: bool) -> None:
        streams, calls = list(self._requests.values()), list(self._calls.values())
        self._requests.clear()
        self._calls.clear()

        def fail() -> None:
            for stream in streams:
                stream.finish(exc)
            for future in calls:
                if not future.done():
                    future.set_exception(exc)

        if on_loop or self._loop is None:
            fail()
        else:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(fail)


def _stop_core(proc: multiprocessing.process.BaseProcess, shm_prefixes: list[str], ipc_dir: str) -> None:
    """SIGTERM (the core aborts and stops its workers), then kill what outlives the grace; nothing is left."""
    if proc.is_alive():
        proc.terminate()
        proc.join(_STOP_TIMEOUT_S)
        if proc.is_alive():
            logger.warning("the diffusion core did not stop in %.0f s; killing it", _STOP_TIMEOUT_S)
            proc.kill()
            proc.join(2.0)
    for prefix in shm_prefixes:
        cleanup_shm(prefix)
    shutil.rmtree(ipc_dir, ignore_errors=True)
