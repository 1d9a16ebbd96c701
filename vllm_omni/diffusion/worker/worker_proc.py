"""The body of a diffusion worker process: connect to the engine, load, then serve messages until told to stop.

Messages arrive on a PULL socket (one per worker) and results leave on this worker's own PUSH socket, so the
engine reads each rank's results independently. Batch results come from rank 0 only (all ranks compute the
same batch); RPC results come from every rank.

Two small threads run beside the loop, because the loop itself is inside a forward most of the time: one
reads the abort channel into a set the pipeline checks between steps, one waits on the death pipe (vLLM's
`death_pipe`: the executor holds its only write end) and ends the process, sweeping the engine's shared memory
and socket files, as soon as the engine's process is gone, even by a SIGKILL, and even when that happened
before this process started (a restart the engine's shutdown overtook). A pipe rather than PR_SET_PDEATHSIG:
the death signal fires when the *thread* that spawned us exits, and engines are built and restarted from
short-lived threads. SIGINT is ignored (a terminal's Ctrl-C reaches the whole group): the engine decides when
its workers stop.

In step mode (`od_config.step_execution`) the engine's scheduler sends one `StepPlan` per denoise-step round to
every rank and this rank's `StepWorker` executes it on the states it keeps by request id: every rank runs the same
plan, so no rank decides for the others and the ranks exchange nothing but the step's own collectives and the
per-phase failure comparison. Rank 0 sends the round's `StepResult`.

Nothing one request brings can end the loop: a message that cannot be decoded, a forward that raises, an
output that cannot be encoded each fail the requests concerned, and the worker serves the next message. The one
exception is a multi-rank stage whose ranks failed differently (`distributed/rank_errors.py`): their
collectives are out of step, so the failed requests' errors are sent and the worker exits (code 1), which
makes the engine restart all of the stage's workers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import psutil
import zmq

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.rank_errors import RanksDesynchronized
from vllm_omni.diffusion.ipc import (
    AbortInput,
    AbortRequests,
    EncodedBatchResult,
    EncodedStepResult,
    ExecuteBatch,
    MsgCodec,
    PartialResult,
    RpcCall,
    RpcResult,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerInitFailed,
    WorkerInput,
    WorkerReady,
    cleanup_shm,
    connect_to_parent,
)
from vllm_omni.logger import configure_process_logging

_POLL_INTERVAL_MS = 200


@dataclass
class WorkerSpec:
    """Everything a spawned worker needs (pickled once at spawn)."""

    od_config: OmniDiffusionConfig
    rank: int
    world_size: int
    input_address: str
    output_address: str
    abort_address: str
    ipc_dir: str
    """The engine's socket directory: removed by the worker that outlives the engine."""
    shm_prefix: str
    distributed_init_method: str | None
    store_socket: socket.socket | None
    """Rank 0's: the rendezvous store's listening socket, bound by the engine on the init method's port."""
    shm_threshold: int
    """Tensors above this many bytes go through shared memory (the engine's choice: none when ranks may be
    on other nodes)."""


class AbortedRequests:
    """(batch_id, request_id) pairs the engine aborted; filled by the abort thread, read inside forwards."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: set[tuple[int, str]] = set()

    def add(self, msg: AbortRequests) -> None:
        with self._lock:
            self._pairs.update((msg.batch_id, rid) for rid in msg.request_ids)

    def contains(self, batch_id: int, request_id: str) -> bool:
        with self._lock:
            return (batch_id, request_id) in self._pairs

    def forget_through(self, batch_id: int) -> None:
        """Drop the aborts of finished batches (an abort may arrive after its batch ended)."""
        with self._lock:
            self._pairs = {pair for pair in self._pairs if pair[0] > batch_id}


class WorkerProc:
    def __init__(self, spec: WorkerSpec) -> None:
        self.started = time.time()
        """When this process began running our code (after its interpreter start and the spec's imports)."""
        self.spec = spec
        self.rank = spec.rank
        self.dlo_wave = spec.od_config.enable_distributed_layerwise_offload
        """DLO: every batch is a wave in which this rank runs request `rank` (or, beyond the wave, a copy of
        request 0 whose output it drops) and sends its own output."""
        self.context, self.input, self.output = connect_to_parent(spec.input_address, spec.output_address)
        self.codec = MsgCodec(None, spec.shm_prefix, spec.shm_threshold)
        self.decoder = MsgCodec(WorkerInput, spec.shm_prefix).decoder()
        self.worker = None
        self.steps = None
        """The `StepWorker` in step mode; None in request mode."""
        self.aborted = AbortedRequests()
        self._stop = threading.Event()
        self._abort_thread = threading.Thread(target=self._read_aborts, name="abort-reader", daemon=True)
        self._abort_thread.start()

    @staticmethod
    def run(spec: WorkerSpec) -> int:
        """Serve until shut down; returns the process exit code."""
        proc = WorkerProc(spec)
        try:
            if not proc.start_worker():
                return 1
            proc.serve()
            return 0
        except RanksDesynchronized as exc:
            for batch_id, outputs in exc.batches:  # from every rank: the first to exit has sent them
                proc._send_outputs(batch_id, outputs, out_of_step=str(exc))
            print(f"[diffusion rank {proc.rank}] exiting, the stage restarts its workers: {exc}", file=sys.stderr)
            proc.worker = None  # its process groups are out of step: no collective teardown
            return 1
        finally:
            proc.shutdown()

    def start_worker(self) -> bool:
        spec = self.spec
        try:
            start = time.perf_counter()
            from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

            imported = time.perf_counter()
            self.worker = DiffusionWorker(spec.od_config, spec.rank, spec.world_size, spec.distributed_init_method,
                                          spec.store_socket)
            self.worker.init_device()
            device = time.perf_counter()
            self.worker.load_model()
        except BaseException:
            self._send(WorkerInitFailed(rank=self.rank, error=traceback.format_exc()))
            return False
        startup = {
            "worker process": self.started - psutil.Process().create_time(),
            "worker imports": imported - start,
            "device": device - imported,
            **self.worker.model_runner.startup_phases,
        }
        if spec.od_config.step_execution:
            from vllm_omni.diffusion.worker.step_runner import StepWorker

            self.steps = StepWorker(self.worker.model_runner, self.rank, multi_rank=spec.world_size > 1)
        info = {
            **self.worker.ping(),
            "pipeline_class": self.worker.model_runner.pipeline_class_name,
            "startup_s": startup,
        }
        if self.worker.device.type == "cuda":  # what requests may use: the engine's memory admission budget
            import torch

            device = self.worker.device
            free, total = torch.cuda.mem_get_info(device)
            # A per-process cap (torch.cuda.set_per_process_memory_fraction) bounds what this process may allocate.
            fraction = torch.cuda.get_per_process_memory_fraction(device)
            capped = int(fraction * total) - torch.cuda.memory_reserved(device)
            info["free_memory_bytes"] = max(min(free, capped), 0)
            # What the worker holds between requests (weights, the captured graphs' outputs): a request's peak
            # beyond it is what the measured peaks and memory admission count.
            info["allocated_bytes"] = torch.cuda.memory_allocated(device)
            info["measured_peaks"] = [{"size": peak.size, "bytes": peak.bytes, "steps": peak.steps}
                                      for peak in self.worker.model_runner.measured_peaks]
        self._send(WorkerReady(rank=self.rank, info=info))
        return True

    def serve(self) -> None:
        while True:
            if self.input.poll(_POLL_INTERVAL_MS) and not self._handle_next():
                return

    def _handle_next(self) -> bool:
        """Read and handle one message; False for Shutdown."""
        buffer = self.input.recv(copy=False).buffer
        try:
            msg = self.decoder.decode(buffer)
        except Exception as exc:
            self._undecodable(buffer, exc)
            return True
        if isinstance(msg, Shutdown):
            return False
        try:
            if isinstance(msg, StepPlan):
                self._step(msg)
            elif isinstance(msg, ExecuteBatch):
                self._execute(msg)
            elif isinstance(msg, RpcCall):
                self._rpc(msg)
        except RanksDesynchronized:
            raise
        except Exception:  # a bug in the handling of one message must not end the worker
            traceback.print_exc()
        return True

    def _partial_sink(self, batch_id: int, stream_request_ids: list[str]):
        """The partial-output sink of a batch's (or round's) streamed requests (None when none streams)."""
        if self.rank != 0 or not stream_request_ids:
            return None
        wanted = frozenset(stream_request_ids)

        def sink(request_id: str, kind: str, data: dict) -> None:
            if request_id in wanted:
                self._send_partial(PartialResult(batch_id, request_id, kind, data))

        return sink

    def _step(self, plan: StepPlan) -> None:
        """Execute one round; a round whose ranks fell out of step is reported by every rank, then we exit."""
        if self.steps is None:
            raise RuntimeError("a step plan reached a worker that runs in request mode")
        try:
            result = self.steps.execute(plan, self._partial_sink(plan.round_id, plan.stream))
        except Exception:  # a bug in the round: the engine fails the requests this result does not account for
            traceback.print_exc()
            result = StepResult(round_id=plan.round_id, rank=self.rank)
        if self.rank == 0 or result.out_of_step is not None:
            self._send_step_result(result)
        if result.out_of_step is not None:
            raise RanksDesynchronized(result.out_of_step, {})

    def _execute(self, msg: ExecuteBatch) -> None:
        from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

        if self.dlo_wave:
            self._execute_wave(msg)
            return
        sink = self._partial_sink(msg.batch_id, msg.stream_request_ids)
        try:
            outputs = self.worker.execute_model(
                DiffusionRequestBatch(msg.requests),
                partial_sink=sink,
                abort_requested=lambda rid: self.aborted.contains(msg.batch_id, rid),
            )
        except RanksDesynchronized as exc:  # the batch fails with its errors, then this worker exits
            exc.batches.append((msg.batch_id, [exc.output_for(i) for i in range(len(msg.requests))]))
            raise
        except Exception as exc:  # e.g. asleep: every request of the batch fails, the worker keeps serving
            outputs = [DiffusionOutput.from_exception(exc) for _ in msg.requests]
        finally:
            self.aborted.forget_through(msg.batch_id)
        if self.rank == 0:
            self._send_outputs(msg.batch_id, outputs)

    def _execute_wave(self, msg: ExecuteBatch) -> None:
        """One DLO wave. An aborted request keeps running to the end here (its rank's peers need every block's
        collective) and is reported aborted."""
        from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
        from vllm_omni.errors import RequestAbortedError

        own = self.rank < len(msg.requests)
        request = msg.requests[self.rank if own else 0]
        sink = None
        if own and request.request_id in msg.stream_request_ids:
            def sink(request_id: str, kind: str, data: dict) -> None:
                self._send_partial(PartialResult(msg.batch_id, request_id, kind, data))
        try:
            (output,) = self.worker.execute_model(DiffusionRequestBatch([request]), partial_sink=sink)
        except Exception as exc:
            output = DiffusionOutput.from_exception(exc)
        if self.aborted.contains(msg.batch_id, request.request_id):
            output = DiffusionOutput.from_exception(RequestAbortedError(f"request {request.request_id} aborted"))
        self.aborted.forget_through(msg.batch_id)
        if own:
            self._send_outputs(msg.batch_id, [output])

    def _send_outputs(self, batch_id: int, outputs: list[DiffusionOutput], out_of_step: str | None = None) -> None:
        encoded, errors = self.codec.encode_each(outputs)
        for i, exc in enumerate(errors):
            if exc is not None:
                error = DiffusionOutput.from_exception(RuntimeError(f"pipeline output cannot be sent: {exc!r}"))
                encoded[i] = msgspec.Raw(self.codec.encode(error))
        self._send(EncodedBatchResult(batch_id=batch_id, rank=self.rank, outputs=encoded, out_of_step=out_of_step))

    def _send_step_result(self, result: StepResult) -> None:
        encoded, errors = self.codec.encode_each(list(result.outputs.values()))
        outputs = {}
        for rid, raw, exc in zip(result.outputs, encoded, errors, strict=True):
            if exc is not None:
                error = DiffusionOutput.from_exception(RuntimeError(f"pipeline output cannot be sent: {exc!r}"))
                raw = msgspec.Raw(self.codec.encode(error))
            outputs[rid] = raw
        self._send(
            EncodedStepResult(
                round_id=result.round_id,
                rank=self.rank,
                outputs=outputs,
                progress=result.progress,
                forwards=result.forwards,
                encode_seconds=result.encode_seconds,
                decode_seconds=result.decode_seconds,
                out_of_step=result.out_of_step,
            )
        )

    def _undecodable(self, buffer: memoryview, exc: Exception) -> None:
        """Fail the batch (or RPC) whose message could not be decoded, if its envelope says which it was."""
        try:
            tag, call_id, *rest = msgspec.msgpack.decode(buffer)
        except Exception:
            tag, call_id, rest = None, None, []
        print(f"[diffusion rank {self.rank}] undecodable {tag or 'message'}: {exc!r}", file=sys.stderr)
        if tag == "batch" and self.rank == 0:
            error = DiffusionOutput.from_exception(RuntimeError(f"request cannot be decoded by the worker: {exc!r}"))
            self._send_outputs(call_id, [error] * len(rest[0] if rest and isinstance(rest[0], list) else []))
        elif tag == "plan" and self.rank == 0:  # the engine fails the requests the result does not account for
            self._send(EncodedStepResult(round_id=call_id, rank=self.rank))
        elif tag == "rpc":
            self._send(RpcResult(call_id=call_id, rank=self.rank, error=f"undecodable call: {exc!r}"))

    def _send_partial(self, msg: PartialResult) -> None:
        """A partial that cannot be encoded is dropped (the final output still comes); the forward goes on."""
        try:
            self._send(msg)
        except Exception as exc:
            print(
                f"[diffusion rank {self.rank}] dropped a {msg.kind!r} partial of {msg.request_id}: {exc!r}",
                file=sys.stderr,
            )

    def _read_aborts(self) -> None:
        sock = self.context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.spec.abort_address)
        decoder = msgspec.msgpack.Decoder(AbortInput)
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_INTERVAL_MS):
                    try:
                        self.aborted.add(decoder.decode(sock.recv()))
                    except msgspec.DecodeError as exc:
                        print(f"[diffusion rank {self.rank}] undecodable abort: {exc!r}", file=sys.stderr)
        finally:
            sock.close(linger=0)

    def _rpc(self, msg: RpcCall) -> None:
        from vllm_omni.diffusion.worker.diffusion_worker import RPC_METHODS

        try:
            if msg.method not in RPC_METHODS:
                raise ValueError(f"unknown diffusion worker method {msg.method!r}; one of {sorted(RPC_METHODS)}")
            value = getattr(self.worker, msg.method)(*msg.args, **msg.kwargs)
            self._send(RpcResult(call_id=msg.call_id, rank=self.rank, value=value))
        except Exception as exc:
            self._send(RpcResult(call_id=msg.call_id, rank=self.rank, error=f"{type(exc).__name__}: {exc}"))

    def _send(self, msg: msgspec.Struct) -> None:
        self.output.send(self.codec.encode(msg), copy=False)

    def shutdown(self) -> None:
        self._stop.set()
        self._abort_thread.join(2 * _POLL_INTERVAL_MS / 1000)
        if self.worker is not None:
            try:
                self.worker.shutdown()
            except Exception:
                traceback.print_exc()
        self.input.close(linger=0)
        self.output.close()
        self.context.term()


def _watch_death_pipe(spec: WorkerSpec, death_pipe: Connection) -> None:
    """End the process once the engine's end of the pipe closed (it never writes), leaving none of its resources."""
    with contextlib.suppress(EOFError, OSError):
        death_pipe.recv()
    cleanup_shm(spec.shm_prefix)
    shutil.rmtree(spec.ipc_dir, ignore_errors=True)
    os._exit(1)


def worker_main(spec: WorkerSpec, death_pipe: Connection, inherited_fds: list[int]) -> None:
    """Process entry point. `inherited_fds`: the executor's write ends a forked worker got a copy of (closed here, so
    that only the executor's keep the pipes open). Everything is released by the time `run` returns, so after the
    exit handlers the process skips the interpreter teardown (seconds of module finalization with torch loaded)."""
    for fd in inherited_fds:
        os.close(fd)
    threading.Thread(target=_watch_death_pipe, args=(spec, death_pipe), name="death-pipe", daemon=True).start()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a worker forked from the core inherits the core's handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_process_logging(spec.od_config.logging_config, f"DiffusionWorker_S{spec.od_config.stage_id}_R{spec.rank}")
    code = 1
    try:
        code = WorkerProc.run(spec)
    finally:
        atexit._run_exitfuncs()  # e.g. multiprocessing's finalizers release tqdm's semaphore
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
