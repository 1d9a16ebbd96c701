"""Messages between the diffusion engine and its worker processes, and how they travel.

Every message is a tagged msgspec struct encoded as msgpack. Arrays, tensors and PIL images inside a
message are msgpack extensions: small ones ride inline, ones above `SHM_TENSOR_THRESHOLD` bytes go
through a POSIX shared-memory segment that the receiver copies out and unlinks at once. Segment names
start with the engine's prefix (`vllm_omni_<token>_`), so the engine can sweep whatever a killed process
left behind. Dtypes numpy lacks (bfloat16, float8) travel as same-width integers and are restored bit-exact.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgspec
import numpy as np
import zmq

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest

SHM_TENSOR_THRESHOLD = 1_000_000
SHM_NAME_PREFIX = "vllm_omni_"
_SHM_DIR = "/dev/shm"

_EXT_NDARRAY = 1
_EXT_TENSOR = 2
_EXT_PIL = 3


class ExecuteBatch(msgspec.Struct, tag="batch", array_like=True, gc=False):
    batch_id: int
    requests: list[OmniDiffusionRequest]
    stream_request_ids: list[str] = []
    """Requests whose submitter listens for `PartialResult`s (rank 0 sends them)."""


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    """Requests of batch `batch_id` to stop; sent on the abort channel, which a worker reads while it runs a
    forward (its input socket is only read between batches)."""

    batch_id: int
    request_ids: list[str]


class RpcCall(msgspec.Struct, tag="rpc", array_like=True, gc=False):
    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False):
    pass


class WorkerReady(msgspec.Struct, tag="ready", array_like=True, gc=False):
    rank: int
    info: dict[str, Any] = {}


class WorkerInitFailed(msgspec.Struct, tag="init_failed", array_like=True, gc=False):
    rank: int
    error: str


class BatchResult(msgspec.Struct, tag="result", array_like=True, gc=False):
    batch_id: int
    rank: int
    outputs: list[DiffusionOutput]
    out_of_step: str | None = None
    """Set when the ranks failed differently (`distributed/rank_errors.py`): the workers exit after this."""


class EncodedBatch(msgspec.Struct, tag="batch", array_like=True, gc=False):
    """`ExecuteBatch` as the engine sends it: each request encoded on its own, so a request that cannot be
    encoded (e.g. a lone surrogate in its prompt) fails alone instead of its whole batch."""

    batch_id: int
    requests: list[msgspec.Raw]
    stream_request_ids: list[str] = []


class EncodedBatchResult(msgspec.Struct, tag="result", array_like=True, gc=False):
    """`BatchResult` as a worker sends it: each output encoded on its own, so an output that cannot be sent
    fails its request only."""

    batch_id: int
    rank: int
    outputs: list[msgspec.Raw]
    out_of_step: str | None = None


class PartialResult(msgspec.Struct, tag="partial", array_like=True, gc=False):
    """Something a request produced before its final output: kind "progress" ({step, total}) or
    "video_chunk" ({video: uint8 frames, fps, frame_start}). Sent on the same socket as, and before, the
    `BatchResult` / `StepResult`, so a request's partials never arrive after its final output."""

    batch_id: int
    """The batch's id, or in step mode the round's."""
    request_id: str
    kind: str
    data: dict[str, Any] = {}


class StepPlan(msgspec.Struct, tag="plan", array_like=True, gc=False):
    """One step-mode round, decided by the engine's `DiffusionScheduler` and executed alike by every rank.

    The ranks keep each admitted request's `DenoiseState` by request id between rounds; a resident request left
    out of `step` stays paused with its latents. A state whose last step ran is decoded in the same round."""

    round_id: int
    new: list[OmniDiffusionRequest] = []
    """Requests admitted this round: encoded and given initial latents before they step."""
    stream: list[str] = []
    """Of `new`, the requests whose submitter listens for `PartialResult`s (rank 0 sends them)."""
    step: list[str] = []
    """The requests that take one denoise step this round, most urgent first."""
    abort: list[str] = []
    """Resident or paused requests to drop (their states are freed) before anything steps."""


class EncodedStepPlan(msgspec.Struct, tag="plan", array_like=True, gc=False):
    """`StepPlan` as the engine sends it: each new request encoded on its own (one that cannot be encoded fails
    alone)."""

    round_id: int
    new: list[msgspec.Raw] = []
    stream: list[str] = []
    step: list[str] = []
    abort: list[str] = []


class StepResult(msgspec.Struct, tag="step_result", array_like=True, gc=False):
    """What a round did (rank 0's; every rank's when the ranks fell out of step), for the scheduler's update."""

    round_id: int
    rank: int
    outputs: dict[str, DiffusionOutput] = {}
    """Requests that left this round: decoded, failed or aborted."""
    progress: dict[str, tuple[int, int]] = {}
    """(steps done, total steps) of every state the ranks still hold after the round (resident or paused)."""
    forwards: list[tuple[list[str], float]] = []
    """The round's transformer forwards: the request ids that shared each, and its seconds."""
    encode_seconds: dict[str, float] = {}
    decode_seconds: dict[str, float] = {}
    out_of_step: str | None = None
    """Set when the ranks failed differently (`distributed/rank_errors.py`): the workers exit after this."""


class EncodedStepResult(msgspec.Struct, tag="step_result", array_like=True, gc=False):
    """`StepResult` as a worker sends it: each output encoded on its own (one that cannot be sent fails alone)."""

    round_id: int
    rank: int
    outputs: dict[str, msgspec.Raw] = {}
    progress: dict[str, tuple[int, int]] = {}
    forwards: list[tuple[list[str], float]] = []
    encode_seconds: dict[str, float] = {}
    decode_seconds: dict[str, float] = {}
    out_of_step: str | None = None


class RpcResult(msgspec.Struct, tag="rpc_result", array_like=True, gc=False):
    call_id: int
    rank: int
    value: Any = None
    error: str | None = None


WorkerInput = ExecuteBatch | StepPlan | RpcCall | Shutdown
AbortInput = AbortRequests
WorkerOutput = WorkerReady | WorkerInitFailed | BatchResult | StepResult | PartialResult | RpcResult


SEND_LINGER_MS = 2000
"""How long a spawned process's close waits for its queued outputs (a last result or error) to leave."""


def connect_to_parent(input_address: str, output_address: str) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """The context and the PULL (input) and PUSH (output) sockets a spawned process (the diffusion core, a worker)
    connects to the pair its parent bound."""
    context = zmq.Context(io_threads=1)
    pull = context.socket(zmq.PULL)
    pull.connect(input_address)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    push.connect(output_address)
    return context, pull, push


def new_shm_prefix() -> str:
    return f"{SHM_NAME_PREFIX}{os.getpid()}_{os.urandom(3).hex()}_"


class MsgCodec:
    """Encodes/decodes one direction's messages; large buffers go through shm segments named `prefix*`."""

    def __init__(self, decode_type: Any, shm_prefix: str, shm_threshold: int = SHM_TENSOR_THRESHOLD) -> None:
        self.shm_prefix = shm_prefix
        self.shm_threshold = shm_threshold
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decode_type = decode_type
        self._segments: list[str] = []

    def encode(self, msg: Any) -> bytes:
        """Encode `msg`; when it fails, the segments made for it are unlinked before the error propagates."""
        with self._lock:
            self._segments = []
            try:
                return self._encoder.encode(msg)
            except BaseException:
                for name in self._segments:
                    _unlink_segment(name)
                raise

    def encode_each(self, items: list[Any]) -> tuple[list[msgspec.Raw | None], list[Exception | None]]:
        """Encode items one by one: (encoded or None, error or None) per item, in order."""
        encoded: list[msgspec.Raw | None] = []
        errors: list[Exception | None] = []
        for item in items:
            try:
                encoded.append(msgspec.Raw(self.encode(item)))
                errors.append(None)
            except Exception as exc:
                encoded.append(None)
                errors.append(exc)
        return encoded, errors

    def decoder(self) -> msgspec.msgpack.Decoder:
        """A decoder for one reading thread (decoders are not shared across threads)."""
        return msgspec.msgpack.Decoder(self._decode_type, ext_hook=_ext_hook)

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return msgspec.msgpack.Ext(_EXT_NDARRAY, self._pack_array(obj, None))
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return msgspec.msgpack.Ext(_EXT_TENSOR, self._pack_tensor(obj))
        pil = sys.modules.get("PIL.Image")
        if pil is not None and isinstance(obj, pil.Image):
            return msgspec.msgpack.Ext(_EXT_PIL, self._pack_array(np.asarray(obj), obj.mode))
        raise NotImplementedError(f"cannot send an object of type {type(obj).__name__} between processes")

    def _pack_tensor(self, tensor: Any) -> bytes:
        import torch

        tensor = tensor.detach().to("cpu").contiguous()
        torch_dtype = str(tensor.dtype).removeprefix("torch.")
        try:
            array = tensor.numpy()
        except TypeError:  # bfloat16 / float8: ship the raw bits as an integer of the same width
            same_width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
            array = tensor.view(same_width).numpy()
        return self._pack_array(array, torch_dtype)

    def _pack_array(self, array: np.ndarray, tag: str | None) -> bytes:
        if array.dtype.hasobject:
            raise NotImplementedError("object arrays cannot be sent between processes")
        array = np.ascontiguousarray(array)
        header: list[Any] = [array.dtype.str, list(array.shape), tag]
        if array.nbytes < self.shm_threshold:
            return msgspec.msgpack.encode([*header, array.tobytes(), None])
        name = f"{self.shm_prefix}{os.getpid()}_{next(self._counter)}"
        shm = SharedMemory(name=name, create=True, size=max(array.nbytes, 1))
        self._segments.append(name)
        # The receiver unlinks the segment; the creator must not also track it (it would "clean" it at exit).
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        view = np.ndarray(array.shape, array.dtype, buffer=shm.buf)
        view[...] = array
        del view
        shm.close()
        return msgspec.msgpack.encode([*header, None, name])


def _ext_hook(code: int, data: memoryview) -> Any:
    dtype, shape, tag, inline, shm_name = msgspec.msgpack.decode(data)
    if inline is not None:
        array = np.frombuffer(inline, dtype=np.dtype(dtype)).reshape(shape).copy()
    else:
        array = _read_shm(shm_name, np.dtype(dtype), shape)
    if code == _EXT_NDARRAY:
        return array
    if code == _EXT_PIL:
        from PIL import Image

        image = Image.fromarray(array)
        return image if image.mode == tag else image.convert(tag)
    if code == _EXT_TENSOR:
        import torch

        tensor = torch.from_numpy(array)
        target = getattr(torch, tag)
        return tensor if tensor.dtype == target else tensor.view(target)
    raise ValueError(f"unknown msgpack extension code {code}")


def _read_shm(name: str, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    shm = SharedMemory(name=name)
    try:
        view = np.ndarray(shape, dtype, buffer=shm.buf)
        array = view.copy()
        del view
    finally:
        shm.close()
        shm.unlink()
    return array


def _unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(_SHM_DIR, name))


def cleanup_shm(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with `prefix` (what dead processes left); returns their names."""
    removed = []
    try:
        names = os.listdir(_SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
