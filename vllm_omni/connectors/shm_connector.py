"""Shared-memory connector: large tensors go into POSIX shared memory, the handle carries only names.

The producer writes each large tensor once into its own segment (the one unavoidable copy); readers map the
segment and get a zero-copy view. The segment's name is unlinked after the last reader in this process took
it, on `release`/`drop_request` (abort, failure) or on `close`, so /dev/shm never outlives the request; live
views stay valid after the unlink because the mapping, not the name, holds the memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from vllm_omni.connectors.base import HeldPayloads, PayloadHandle, StagePayload

_INLINE_KEY = "__inline_tensors__"
_SHM_DIR = "/dev/shm"


def segment_prefix() -> str:
    """Name prefix of the /dev/shm segments this process writes: a leaked segment says which process made it."""
    return f"omni_{os.getpid()}_"


class SharedMemoryConnector(HeldPayloads):
    def __init__(self, threshold_bytes: int = 1_000_000) -> None:
        super().__init__()
        self.threshold_bytes = threshold_bytes

    def put(self, request_id: str, src_stage: int, dst_stage: int, payload: StagePayload,
            num_readers: int = 1, chunk: int | None = None) -> PayloadHandle:
        key = self.make_key(request_id, src_stage, dst_stage, chunk)
        inline: dict[str, torch.Tensor] = {}
        specs: list[tuple[str, str, str, tuple[int, ...]]] = []
        segments: list[shared_memory.SharedMemory] = []
        try:
            for name, tensor in payload.tensors.items():
                tensor = tensor.detach()
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes < self.threshold_bytes or nbytes == 0:
                    inline[name] = tensor.cpu()
                    continue
                segment_name = f"{segment_prefix()}{uuid.uuid4().hex[:16]}"
                shm = shared_memory.SharedMemory(create=True, size=nbytes, name=segment_name)
                segments.append(shm)
                _write(shm, tensor)
                specs.append((name, shm.name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        except BaseException:
            for shm in segments:
                _free(shm)
            raise
        self._hold(key, request_id, segments, num_readers)
        metadata = dict(payload.metadata)
        if inline:
            metadata[_INLINE_KEY] = inline
        return PayloadHandle(key=key, request_id=request_id, metadata=metadata, tensor_specs=specs)

    def get(self, handle: PayloadHandle) -> StagePayload:
        """Zero-copy views on the segments; the last reader in this process unlinks them."""
        with self._lock:
            if handle.key not in self._entries:
                raise KeyError(f"payload {handle.key} was already consumed or dropped")
            tensors = {name: _map(seg, getattr(torch, dtype), shape) for name, seg, dtype, shape in handle.tensor_specs}
            self._take(handle.key)
        return _payload(handle, tensors)

    @staticmethod
    def open_handle(handle: PayloadHandle) -> StagePayload:
        """For a reader in another process: map the segments by name (the producer stays the owner)."""
        tensors = {name: _map(seg, getattr(torch, dtype), shape) for name, seg, dtype, shape in handle.tensor_specs}
        return _payload(handle, tensors)

    def _free(self, held: list[shared_memory.SharedMemory]) -> None:
        for shm in held:
            _free(shm)


def _write(shm: shared_memory.SharedMemory, tensor: torch.Tensor) -> None:
    """Copy `tensor` into the segment, then drop the producer's mapping (readers map it themselves)."""
    target = torch.from_numpy(np.frombuffer(shm.buf, dtype=np.uint8)).view(tensor.dtype).view(tensor.shape)
    target.copy_(tensor)
    del target
    shm.close()


def _map(segment: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor on its own mapping of the segment; the mapping lives exactly as long as the tensor does."""
    fd = os.open(os.path.join(_SHM_DIR, segment), os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8)).view(dtype).view(shape)


def _free(shm: shared_memory.SharedMemory) -> None:
    """Unlink the name; mapped views stay valid until they are garbage collected."""
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def _payload(handle: PayloadHandle, tensors: dict[str, torch.Tensor]) -> StagePayload:
    metadata: dict[str, Any] = dict(handle.metadata)
    tensors = {**metadata.pop(_INLINE_KEY, {}), **tensors}
    return StagePayload(metadata=metadata, tensors=tensors)
