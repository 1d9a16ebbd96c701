"""One spawned worker process per rank, driven over ZeroMQ sockets with msgspec messages.

Each rank has its own input socket and its own result socket. The executor runs no thread of its own: the
thread that drives it (the engine's loop: the diffusion core's busy loop) polls `result_sockets` and the
worker processes' `sentinels` with its other sockets, then calls `process_results` (resolves futures, hands
partials on) and, when a sentinel is ready, `check_workers`. One more socket publishes aborts to every rank: a
worker reads it on a side thread while it is busy inside a forward. A worker that dies for any reason fails
every in-flight future with `EngineDeadError` once what it sent before dying was read, fires the failure
callbacks, and then every worker is reaped and the shared memory and socket files removed (not at shutdown: a
dead executor is replaced, not kept). `shutdown` works against one global deadline (abort, ask, join,
terminate, kill) and cleans up the same way. Each worker also holds the read end of a pipe whose only write end
is ours (vLLM's death pipe): it ends itself once that closes, when this process exits however it does.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection
from typing import Any

import zmq

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.ipc import (
    SHM_TENSOR_THRESHOLD,
    AbortRequests,
    BatchResult,
    EncodedBatch,
    EncodedStepPlan,
    MsgCodec,
    PartialResult,
    RpcCall,
    RpcResult,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerInitFailed,
    WorkerOutput,
    WorkerReady,
    cleanup_shm,
    new_shm_prefix,
)
from vllm_omni.diffusion.offload.distributed import dlo_wave_error
from vllm_omni.diffusion.process_start import child_process, start_context
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.worker_proc import WorkerSpec, worker_main
from vllm_omni.errors import EngineDeadError, OmniClientError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

_DRAIN_MS = 100
"""After a worker died: how long what the ranks sent before (e.g. their requests' errors) may take to arrive."""
_DEFAULT_RPC_TIMEOUT_S = 600.0
_SEND_TIMEOUT_MS = 5000
_SHUTDOWN_TIMEOUT_S = 10.0
"""Abort, ask, terminate, kill: a server's SIGTERM must end within 15 s with a busy worker."""


class _PendingBatch:
    """A batch on the workers: its future, its request ids, and the outputs already known (requests that
    could not be encoded never went out and fail alone)."""

    def __init__(self, request_ids: list[str], failed: dict[int, DiffusionOutput]) -> None:
        self.future: Future[list[DiffusionOutput]] = Future()
        self.request_ids = request_ids
        self.failed = failed

    def outputs(self, sent: list[DiffusionOutput]) -> list[DiffusionOutput]:
        """All outputs in request order: the workers' for the requests sent, the known failures for the rest."""
        sent_iter = iter(sent)
        missing = DiffusionOutput.from_exception(RuntimeError("the worker returned too few outputs"))
        return [self.failed[i] if i in self.failed else next(sent_iter, missing) for i in range(len(self.request_ids))]


class _PendingWave(_PendingBatch):
    """A DLO wave: request i runs on rank i, and each of those ranks sends its own output."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(request_ids, {})
        self.by_rank: dict[int, DiffusionOutput] = {}

    def add(self, rank: int, outputs: list[DiffusionOutput]) -> bool:
        """Record rank `rank`'s output; True once every request's rank has sent it."""
        if rank < len(self.request_ids):
            missing = DiffusionOutput.from_exception(RuntimeError(f"rank {rank} returned no output"))
            self.by_rank[rank] = outputs[0] if outputs else missing
        return len(self.by_rank) == len(self.request_ids)

    def wave_outputs(self) -> list[DiffusionOutput]:
        return [self.by_rank[i] for i in range(len(self.request_ids))]


class _PendingPlan:
    """A step round on the workers: its future, and the outputs of the new requests that could not be sent."""

    def __init__(self, failed: dict[str, DiffusionOutput]) -> None:
        self.future: Future[StepResult] = Future()
        self.failed = failed


class _PendingRpc:
    """A `collective_rpc` on the workers: its future resolves once every rank answered (one value per rank)."""

    def __init__(self, method: str, world_size: int) -> None:
        self.future: Future[list[Any]] = Future()
        self.method = method
        self.results: dict[int, RpcResult] = {}
        self.world_size = world_size

    def add(self, msg: RpcResult) -> bool:
        """Record rank `msg.rank`'s answer; True once every rank's is in and the future resolved."""
        self.results[msg.rank] = msg
        if len(self.results) < self.world_size:
            return False
        errors = [f"rank {r.rank}: {r.error}" for r in self.results.values() if r.error is not None]
        if errors:
            error = RuntimeError(f"collective_rpc({self.method!r}) failed: " + "; ".join(errors))
            _settle(self.future, exception=error)
        else:
            _settle(self.future, result=[self.results[rank].value for rank in range(self.world_size)])
        return True


class MultiprocDiffusionExecutor:
    shm_threshold = SHM_TENSOR_THRESHOLD
    """Tensors above this many bytes travel through shared memory (every rank is a process of this host)."""

    def __init__(self, od_config: OmniDiffusionConfig) -> None:
        self.od_config = od_config
        self.world_size = od_config.parallel_config.world_size
        self.shm_prefix = new_shm_prefix()
        self._ipc_dir = tempfile.mkdtemp(prefix="vllm_omni_ipc_")
        self._context = zmq.Context(io_threads=1)
        self._inputs: list[zmq.Socket] = []
        self._outputs: list[zmq.Socket] = []
        self._addresses: dict[str, str] = {}
        """The address each worker connects to, by socket name ("abort", "in<rank>", "out<rank>")."""
        self._abort_pub = self._context.socket(zmq.PUB)
        self._abort_pub.setsockopt(zmq.LINGER, 0)
        self._bind(self._abort_pub, "abort")
        for rank in range(self.world_size):
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)  # a PUSH without a live peer would block forever
            self._bind(push, f"in{rank}")
            pull = self._context.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            self._bind(pull, f"out{rank}")
            self._inputs.append(push)
            self._outputs.append(pull)
        self._codec = MsgCodec(None, self.shm_prefix, self.shm_threshold)
        self._output_codec = MsgCodec(WorkerOutput, self.shm_prefix, self.shm_threshold)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._batches: dict[int, _PendingBatch] = {}
        self._partial_handlers: dict[int, Callable[[PartialResult], None]] = {}
        self._plans: dict[int, _PendingPlan] = {}
        self._step_partials: Callable[[PartialResult], None] | None = None
        """Step mode: where every round's partials go (a request streams across rounds)."""
        self._rpcs: dict[int, _PendingRpc] = {}
        self._failure_callbacks: list[Callable[[], None]] = []
        self._is_failed = False
        self._closed = False
        self._tp_shm_prefixes: list[str] = []
        """vLLM CPU's TP communicator segments are named after the ranks' init port; its workers do not unlink them."""
        self._death_writers: list[Connection] = []
        """Our ends of the workers' death pipes: closed once the workers are gone (or by our exit)."""
        self.processes = self._launch_workers()
        self._finalizer = weakref.finalize(
            self, _reap, self.processes, self.shm_prefix, self._ipc_dir, self._tp_shm_prefixes, self._death_writers
        )
        try:
            self.worker_info = self._wait_until_ready(od_config.init_timeout)
        except BaseException:
            self.shutdown(timeout=5.0)
            raise
        self._decoder = self._output_codec.decoder()

    # ---- startup -------------------------------------------------------------------------------------

    def _bind(self, sock: zmq.Socket, name: str) -> None:
        address = f"ipc://{self._ipc_dir}/{name}"
        sock.bind(address)
        self._addresses[name] = address

    def _worker_spec(self, rank: int, init_method: str | None,
                     store_socket: socket.socket | None = None) -> WorkerSpec:
        return WorkerSpec(
            od_config=self.od_config,
            rank=rank,
            world_size=self.world_size,
            input_address=self._addresses[f"in{rank}"],
            output_address=self._addresses[f"out{rank}"],
            abort_address=self._addresses["abort"],
            ipc_dir=self._ipc_dir,
            shm_prefix=self.shm_prefix,
            distributed_init_method=init_method,
            store_socket=store_socket if rank == 0 else None,
            shm_threshold=self.shm_threshold,
        )

    def _launch_workers(self) -> list[multiprocessing.process.BaseProcess]:
        ctx = _worker_context()
        init_method = store_socket = None
        if self.world_size > 1:
            # Bound here, before any rank starts, and handed to rank 0 (inherited when forked, passed as a
            # descriptor when spawned): a port found free and bound later by rank 0 can be taken meanwhile by
            # another process on the host.
            store_socket = socket.create_server(("127.0.0.1", 0))
            port = store_socket.getsockname()[1]
            init_method = f"tcp://127.0.0.1:{port}"
            self._tp_shm_prefixes.append(f"{port}-")  # VLLM_DIST_IDENT (parallel_state.py)
        forked = ctx.get_start_method() == "fork"
        processes = []
        try:
            for rank in range(self.world_size):
                spec = self._worker_spec(rank, init_method, store_socket)
                death_reader, death_writer = ctx.Pipe(duplex=False)
                self._death_writers.append(death_writer)
                # A forked child has copies of our write ends (its own and earlier ranks'), which would keep its
                # pipe open after our death: it closes them first. A spawned one gets only what it is passed.
                inherited = [w.fileno() for w in self._death_writers] if forked else []
                proc = child_process(ctx, worker_main, (spec, death_reader, inherited), f"DiffusionWorker-{rank}",
                                     daemon=True)
                proc.start()
                death_reader.close()
                processes.append(proc)
        finally:
            if store_socket is not None:  # rank 0 holds its own copy now
                store_socket.close()
        return processes

    def _wait_until_ready(self, timeout: float) -> list[dict[str, Any]]:
        """Every rank's `WorkerReady`. Gives up when a rank fails or exits, at `timeout`, or once the process that
        started this one (the API process, where this is a diffusion core) is gone: loading a large model takes
        minutes, and nobody would be left to serve or stop it."""
        deadline = time.monotonic() + timeout
        starter = multiprocessing.parent_process()
        decoder = self._output_codec.decoder()
        poller = zmq.Poller()
        for sock in self._outputs:
            poller.register(sock, zmq.POLLIN)
        ready: dict[int, dict[str, Any]] = {}
        while len(ready) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(ready))
                raise RuntimeError(
                    f"diffusion worker rank(s) {missing} not ready after {timeout:.0f} s; raise init_timeout "
                    "if loading the model legitimately takes longer"
                )
            events = dict(poller.poll(int(min(remaining, 0.5) * 1000)))
            for sock in self._outputs:
                while sock in events and sock.poll(0):
                    msg = decoder.decode(sock.recv(copy=False).buffer)
                    if isinstance(msg, WorkerInitFailed):
                        raise RuntimeError(f"diffusion worker rank {msg.rank} failed to start:\n{msg.error}")
                    if isinstance(msg, WorkerReady):
                        ready[msg.rank] = msg.info
            for rank, proc in enumerate(self.processes):
                if rank not in ready and not proc.is_alive() and not self._outputs[rank].poll(0):
                    raise RuntimeError(
                        f"diffusion worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
                        "while loading the model"
                    )
            if starter is not None and not starter.is_alive():
                raise RuntimeError(f"the process that started this one (pid {starter.pid}) exited while the "
                                   "diffusion workers loaded the model")
        return [ready[rank] for rank in range(self.world_size)]

    # ---- requests ------------------------------------------------------------------------------------

    @property
    def is_failed(self) -> bool:
        return self._is_failed

    @property
    def result_sockets(self) -> list[zmq.Socket]:
        """One per rank, for the driving thread's poller (`process_results` reads them)."""
        return self._outputs

    @property
    def sentinels(self) -> list[int]:
        """The worker processes' sentinels, ready once a worker exited (then `check_workers`)."""
        return [proc.sentinel for proc in self.processes]

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        self._failure_callbacks.append(callback)

    def execute_batch(
        self,
        requests: list[OmniDiffusionRequest],
        stream_request_ids: list[str] | None = None,
        on_partial: Callable[[PartialResult], None] | None = None,
    ) -> Future[list[DiffusionOutput]]:
        """Run one batch on every rank; the future holds rank 0's outputs (one per request).

        `on_partial` gets the `PartialResult`s of `stream_request_ids` on the result thread, in order and all
        before the future resolves; it must not block.
        """
        batch_id = next(self._ids)
        encoded, errors = self._codec.encode_each(requests)
        failed = {i: _unsendable(exc) for i, exc in enumerate(errors) if exc is not None}
        pending = _PendingBatch([r.request_id for r in requests], failed)
        if self.od_config.enable_distributed_layerwise_offload:
            # Checked before anything is sent: a rank that skipped a block's collective would hang its peers.
            error = dlo_wave_error(requests)
            if error is not None or failed:  # the whole wave, or none of it: every rank must run a request
                output = DiffusionOutput.from_exception(error) if error is not None else next(iter(failed.values()))
                pending.future.set_result([output] * len(requests))
                return pending.future
            pending = _PendingWave(pending.request_ids)
        if len(failed) == len(requests):
            pending.future.set_result(pending.outputs([]))
            return pending.future
        msg = EncodedBatch(
            batch_id=batch_id,
            requests=[raw for raw in encoded if raw is not None],
            stream_request_ids=list(stream_request_ids or []) if on_partial is not None else [],
        )
        data = self._codec.encode(msg)
        with self._lock:
            self._check_alive()
            self._batches[batch_id] = pending
            if on_partial is not None:
                self._partial_handlers[batch_id] = on_partial
        self._broadcast(data)
        return pending.future

    def execute_plan(
        self, plan: StepPlan, on_partial: Callable[[PartialResult], None] | None = None
    ) -> Future[StepResult]:
        """Send one step round to every rank; the future holds rank 0's result. A new request that cannot be
        encoded leaves the plan and fails alone (its output is in the result). `on_partial` gets the partials of
        the plan's streamed requests, in every later round too, on the result thread; it must not block."""
        encoded, errors = self._codec.encode_each(plan.new)
        failed = {
            request.request_id: _unsendable(exc)
            for request, exc in zip(plan.new, errors, strict=True)
            if exc is not None
        }
        msg = EncodedStepPlan(
            round_id=plan.round_id,
            new=[raw for raw in encoded if raw is not None],
            stream=[rid for rid in plan.stream if rid not in failed],
            step=[rid for rid in plan.step if rid not in failed],
            abort=list(plan.abort),
        )
        pending = _PendingPlan(failed)
        data = self._codec.encode(msg)
        with self._lock:
            self._check_alive()
            self._plans[plan.round_id] = pending
            if on_partial is not None:
                self._step_partials = on_partial
        self._broadcast(data)
        return pending.future

    def abort(self, request_ids: list[str]) -> None:
        """Ask the workers to stop these requests inside their running forward (the pipeline checks between
        steps); their batch's result still comes, with the aborted requests' outputs marked as aborted."""
        wanted = set(request_ids)
        with self._lock:
            targets = {
                batch_id: [rid for rid in pending.request_ids if rid in wanted]
                for batch_id, pending in self._batches.items()
            }
        for batch_id, ids in targets.items():
            if ids:
                self._publish_abort(batch_id, ids)

    def _publish_abort(self, batch_id: int, request_ids: list[str]) -> None:
        with contextlib.suppress(zmq.ZMQError, UnicodeEncodeError), self._send_lock:
            self._abort_pub.send(self._codec.encode(AbortRequests(batch_id, request_ids)), flags=zmq.NOBLOCK)

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        """Call a worker method on every rank; one result per rank, in rank order.

        `non_block` (as vLLM's executor): return the future at once; it resolves on the driving thread (in
        `process_results`), fails with `EngineDeadError` when a worker dies, and a caller that stops waiting
        cancels it. Blocking waits up to `timeout` seconds for the driving thread to resolve it, so only another
        thread may block."""
        call_id = next(self._ids)
        pending = _PendingRpc(method, self.world_size)
        with self._lock:
            self._check_alive()
            self._rpcs[call_id] = pending
        pending.future.add_done_callback(lambda _: self._forget_rpc(call_id))
        try:
            self._broadcast(self._codec.encode(RpcCall(call_id, method, list(args), dict(kwargs or {}))))
        except BaseException:
            pending.future.cancel()
            raise
        if non_block:
            return pending.future
        timeout = _DEFAULT_RPC_TIMEOUT_S if timeout is None else timeout
        try:
            return pending.future.result(timeout)
        except TimeoutError:
            pending.future.cancel()
            raise TimeoutError(
                f"collective_rpc({method!r}) got no answer from every rank within {timeout} s"
            ) from None

    def _forget_rpc(self, call_id: int) -> None:
        with self._lock:
            self._rpcs.pop(call_id, None)

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the diffusion engine is closed")
        if self._is_failed:
            raise EngineDeadError()

    def _broadcast(self, data: bytes, flags: int = 0) -> None:
        try:
            with self._send_lock:
                for sock in self._inputs:
                    sock.send(data, flags=flags, copy=False)
        except zmq.Again as exc:
            self.fail("a diffusion worker stopped reading its input")
            raise EngineDeadError("a diffusion worker stopped reading its input") from exc

    # ---- results and worker death (on the driving thread) ------------------------------------------

    def process_results(self) -> None:
        """Dispatch every result the ranks sent so far; never blocks. Only the driving thread reads the result
        sockets (zmq sockets are not thread-safe); futures resolve and partial handlers run on it."""
        for rank, sock in enumerate(self._outputs):
            while True:
                try:
                    frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ZMQError:  # closed by shutdown
                    return
                try:
                    msg = self._decoder.decode(frame.buffer)
                except Exception as exc:  # we cannot tell whose result it was: nobody may wait forever
                    logger.exception("undecodable message from diffusion worker rank %d", rank)
                    self.fail(f"undecodable message from diffusion worker rank {rank}: {exc}")
                    return
                self._dispatch(msg)

    def _dispatch(self, msg: WorkerOutput) -> None:
        if isinstance(msg, PartialResult):
            with self._lock:
                handler = (
                    self._step_partials if self.od_config.step_execution else self._partial_handlers.get(msg.batch_id)
                )
            if handler is not None:
                try:
                    handler(msg)
                except Exception:
                    logger.exception("partial-output handler of batch %d raised", msg.batch_id)
        elif isinstance(msg, BatchResult):
            with self._lock:
                pending = self._batches.get(msg.batch_id)
                wave = isinstance(pending, _PendingWave)  # DLO: every rank returns its own request's output
                done = not wave or pending.add(msg.rank, msg.outputs)
                if done:
                    self._batches.pop(msg.batch_id, None)
                    self._partial_handlers.pop(msg.batch_id, None)
            if msg.out_of_step is not None:  # the workers exit next: restarting starts before this resolves
                self.fail(f"diffusion worker rank {msg.rank}: {msg.out_of_step}")
            if pending is not None and done:
                pending.future.set_result(pending.wave_outputs() if wave else pending.outputs(msg.outputs))
        elif isinstance(msg, StepResult):
            with self._lock:
                pending = self._plans.pop(msg.round_id, None)
            if msg.out_of_step is not None:
                self.fail(f"diffusion worker rank {msg.rank}: {msg.out_of_step}")
            if pending is not None:
                msg.outputs.update(pending.failed)
                pending.future.set_result(msg)
        elif isinstance(msg, RpcResult):
            with self._lock:
                pending = self._rpcs.get(msg.call_id)
            if pending is not None:
                pending.add(msg)

    def check_workers(self) -> None:
        """After a sentinel was ready: a worker that exited fails the executor (once), after what the ranks sent
        before it died was dispatched (ranks that exit because they failed differently send their requests'
        errors first); then every worker is reaped and its resources freed."""
        dead = [(rank, proc) for rank, proc in enumerate(self.processes) if not proc.is_alive()]
        if not dead or self._closed or self._is_failed:
            return
        for _, proc in dead:
            proc.join(0)  # reap now: no zombie, and the exit code for the log
        reason = "; ".join(
            f"diffusion worker rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}" for rank, proc in dead
        )
        logger.error("%s; failing all in-flight diffusion requests", reason)
        poller = zmq.Poller()
        for sock in self._outputs:
            poller.register(sock, zmq.POLLIN)
        self.process_results()
        while poller.poll(_DRAIN_MS):
            self.process_results()
        self.fail(reason)
        self._finalizer()  # reap the dead (no zombie), stop the other ranks, free their shm and sockets

    def fail(self, reason: str) -> None:
        """Mark the executor dead: fail every pending future and fire the failure callbacks (once)."""
        with self._lock:
            if self._is_failed:
                return
            self._is_failed = True
            futures = [pending.future for pending in [*self._batches.values(), *self._plans.values()]]
            self._batches.clear()
            self._plans.clear()
            self._partial_handlers.clear()
            rpcs = [pending.future for pending in self._rpcs.values()]
        for future in futures:
            future.set_exception(EngineDeadError(f"the diffusion engine is dead: {reason}"))
        for future in rpcs:
            _settle(future, exception=EngineDeadError(f"the diffusion engine is dead: {reason}"))
        if not self._closed:
            for callback in self._failure_callbacks:
                try:
                    callback()
                except Exception:
                    logger.exception("diffusion failure callback raised")

    # ---- shutdown ------------------------------------------------------------------------------------

    def stop_workers(self, timeout: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Make sure every worker process is gone (a failed executor's last ones exit on their own, else are
        terminated); touches no socket, so any thread may call it while the driving thread still polls."""
        _stop_processes(self.processes, time.monotonic() + timeout)

    def shutdown(self, timeout: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Stop every worker within `timeout` seconds overall; always returns.

        Running requests are aborted first, so a busy worker leaves its forward within a step and exits
        on its own; what still stands at half the time is terminated, then killed."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        self._closed = True
        with self._lock:
            running = {batch_id: pending.request_ids for batch_id, pending in self._batches.items()}
        for batch_id, ids in running.items():
            self._publish_abort(batch_id, ids)
        with contextlib.suppress(zmq.ZMQError, EngineDeadError):
            self._broadcast(self._codec.encode(Shutdown()), flags=zmq.NOBLOCK)
        _stop_processes(self.processes, deadline)
        self.fail("the diffusion engine was shut down")
        for sock in [*self._inputs, *self._outputs, self._abort_pub]:
            sock.close(linger=0)
        self._context.term()
        self._finalizer()


def _worker_context() -> multiprocessing.context.BaseContext:
    """Fork where this process was told to (`VLLM_WORKER_MULTIPROC_METHOD=fork`: the diffusion core sets it where
    the user chose no start method, plugins.py) and still runs one thread: a forked worker starts with the torch and
    vLLM this process imported; vLLM's `get_mp_context` spawns instead where CUDA is initialized. Otherwise (a
    restart, from a core whose engine threads run; an engine in a process with threads) the preloaded forkserver
    or the user's spawn (`process_start.py`)."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork" and threading.active_count() == 1:
        from vllm.utils.system_utils import get_mp_context

        return get_mp_context()
    return start_context()


def _settle(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    """Resolve unless its caller cancelled it meanwhile (gave up waiting)."""
    with contextlib.suppress(InvalidStateError):
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)


def _unsendable(exc: Exception) -> DiffusionOutput:
    """Text that is not valid Unicode (a lone surrogate) came from the client: 400; anything else is ours."""
    if isinstance(exc, UnicodeEncodeError):
        return DiffusionOutput.from_exception(
            OmniClientError(f"the request has text that is not valid Unicode and cannot be sent to the workers: {exc}")
        )
    return DiffusionOutput.from_exception(exc)


def _stop_processes(processes: list, deadline: float) -> None:
    """Join until half the time left (aborted work leaves within a step), then terminate, then kill."""
    grace_end = time.monotonic() + max(deadline - time.monotonic(), 0.0) * 0.5
    for proc in processes:
        proc.join(max(grace_end - time.monotonic(), 0.0))
    for proc in processes:
        if proc.is_alive():
            logger.warning("diffusion worker %s did not exit in time; terminating it", proc.name)
            proc.terminate()
    for proc in processes:
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def _reap(
    processes: list, shm_prefix: str, ipc_dir: str, tp_shm_prefixes: list[str], death_writers: list[Connection]
) -> None:
    """Last line of cleanup (also run at interpreter exit): no worker, segment or socket file outlives us."""
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for writer in death_writers:  # after the workers are gone: an earlier close would end them mid-shutdown
        writer.close()
    removed = cleanup_shm(shm_prefix)
    for prefix in tp_shm_prefixes:
        removed += cleanup_shm(prefix)
    if removed:
        logger.info("removed %d shared-memory segment(s) left by diffusion workers", len(removed))
    shutil.rmtree(ipc_dir, ignore_errors=True)
