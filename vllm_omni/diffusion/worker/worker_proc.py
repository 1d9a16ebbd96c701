"""The body of a diffusion worker process: connect to the engine, load, then serve messages until told to stop.

Messages arrive on a PULL socket (one per worker) and results leave on this worker's own PUSH socket, so the
engine reads each rank's results independently. Batch results come from rank 0 only (all ranks compute the
same batch); RPC results come from every rank. The loop also exits when the engine process disappears.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import traceback
from dataclasses import dataclass

import msgspec
import zmq

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.ipc import (
    BatchResult,
    ExecuteBatch,
    MsgCodec,
    PartialResult,
    RpcCall,
    RpcResult,
    Shutdown,
    WorkerInitFailed,
    WorkerInput,
    WorkerReady,
)
from vllm_omni.logger import configure_process_logging

_PARENT_CHECK_INTERVAL_MS = 1000
_SEND_LINGER_MS = 2000


@dataclass
class WorkerSpec:
    """Everything a spawned worker needs (pickled once at spawn)."""

    od_config: OmniDiffusionConfig
    rank: int
    world_size: int
    input_address: str
    output_address: str
    shm_prefix: str
    distributed_init_method: str | None


class WorkerProc:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.context = zmq.Context(io_threads=1)
        self.input = self.context.socket(zmq.PULL)
        self.input.connect(spec.input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, _SEND_LINGER_MS)
        self.output.connect(spec.output_address)
        self.codec = MsgCodec(None, spec.shm_prefix)
        self.decoder = MsgCodec(WorkerInput, spec.shm_prefix).decoder()
        self.worker = None

    @staticmethod
    def run(spec: WorkerSpec) -> int:
        """Serve until shut down; returns the process exit code."""
        proc = WorkerProc(spec)
        try:
            if not proc.start_worker():
                return 1
            proc.serve()
            return 0
        finally:
            proc.shutdown()

    def start_worker(self) -> bool:
        from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

        spec = self.spec
        try:
            self.worker = DiffusionWorker(spec.od_config, spec.rank, spec.world_size, spec.distributed_init_method)
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:
            self._send(WorkerInitFailed(rank=self.rank, error=traceback.format_exc()))
            return False
        info = {**self.worker.ping(), "pipeline_class": self.worker.model_runner.pipeline_class_name}
        self._send(WorkerReady(rank=self.rank, info=info))
        return True

    def serve(self) -> None:
        parent = multiprocessing.parent_process()
        while True:
            if not self.input.poll(_PARENT_CHECK_INTERVAL_MS):
                if parent is not None and not parent.is_alive():
                    return
                continue
            msg = self.decoder.decode(self.input.recv(copy=False).buffer)
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, ExecuteBatch):
                self._execute(msg)
            elif isinstance(msg, RpcCall):
                self._rpc(msg)

    def _execute(self, msg: ExecuteBatch) -> None:
        from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

        sink = None
        if self.rank == 0 and msg.stream_request_ids:
            wanted = frozenset(msg.stream_request_ids)

            def sink(request_id: str, kind: str, data: dict) -> None:
                if request_id in wanted:
                    self._send_partial(PartialResult(msg.batch_id, request_id, kind, data))

        try:
            outputs = self.worker.execute_model(DiffusionRequestBatch(msg.requests), partial_sink=sink)
        except Exception as exc:  # e.g. asleep: every request of the batch fails, the worker keeps serving
            outputs = [DiffusionOutput.from_exception(exc) for _ in msg.requests]
        if self.rank != 0:
            return
        try:
            self._send(BatchResult(batch_id=msg.batch_id, rank=self.rank, outputs=outputs))
        except (TypeError, NotImplementedError, msgspec.EncodeError) as exc:
            error = DiffusionOutput.from_exception(RuntimeError(f"pipeline output cannot be sent: {exc}"))
            self._send(BatchResult(batch_id=msg.batch_id, rank=self.rank, outputs=[error] * len(outputs)))

    def _send_partial(self, msg: PartialResult) -> None:
        """A partial that cannot be encoded is dropped (the final output still comes); the forward goes on."""
        try:
            self._send(msg)
        except (TypeError, NotImplementedError, msgspec.EncodeError) as exc:
            print(f"[diffusion rank {self.rank}] dropped a {msg.kind!r} partial of {msg.request_id}: {exc}",
                  file=sys.stderr)

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
        if self.worker is not None:
            try:
                self.worker.shutdown()
            except Exception:
                traceback.print_exc()
        self.input.close(linger=0)
        self.output.close()
        self.context.term()


def worker_main(spec: WorkerSpec) -> None:
    """Process entry point. Everything is released by the time `run` returns, so after the exit handlers the
    process skips the interpreter teardown (seconds of module finalization with torch loaded)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    configure_process_logging(spec.od_config.logging_config,
                              f"DiffusionWorker_S{spec.od_config.stage_id}_R{spec.rank}")
    code = 1
    try:
        code = WorkerProc.run(spec)
    finally:
        atexit._run_exitfuncs()  # e.g. multiprocessing's finalizers release tqdm's semaphore
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
