"""The connector interface and the payload it carries."""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch


@dataclass
class StagePayload:
    """What one stage hands to the next for one request: small metadata plus (possibly large) tensors."""

    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class PayloadHandle(msgspec.Struct, kw_only=True, gc=False):
    """A small, picklable reference to a payload held by a connector; the receiver passes it to `get`."""

    key: str
    request_id: str
    metadata: dict[str, Any] = {}
    tensor_specs: list[tuple[str, str, str, tuple[int, ...]]] = []
    """(name, segment name, dtype, shape) for tensors held outside the handle (shm connector)."""
    ref: Any = None
    """The payload's `ObjectRef` in Ray's object store (ray connector)."""
    producer: str | None = None
    """The process that put the payload and holds it until its readers took it (ray connector: its Ray worker
    id), so that a `get` there counts readers while one elsewhere fetches."""


class OmniConnector(abc.ABC):
    """`put` stores a payload for `num_readers` consumers and returns a handle; each consumer calls `get` once.

    The payload is freed after the last `get`, on `drop_request` (abort / failure) or on `close`, whichever
    comes first, so nothing outlives the request.
    """

    @abc.abstractmethod
    def put(self, request_id: str, src_stage: int, dst_stage: int, payload: StagePayload,
            num_readers: int = 1, chunk: int | None = None) -> PayloadHandle:
        """`chunk`: the index of this payload on a streamed edge, where several are in flight at once."""

    @abc.abstractmethod
    def get(self, handle: PayloadHandle) -> StagePayload: ...

    @abc.abstractmethod
    def drop_request(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @staticmethod
    def make_key(request_id: str, src_stage: int, dst_stage: int, chunk: int | None = None) -> str:
        key = f"{request_id}:{src_stage}->{dst_stage}"
        return key if chunk is None else f"{key}#{chunk}"



@dataclass
class HeldPayload:
    """What a connector holds for one put until its readers took it: `held` is freed by `HeldPayloads._free`."""

    request_id: str
    held: Any
    readers_left: int


class HeldPayloads(OmniConnector):
    """A connector that holds what it put outside the handle (shared-memory segments, an object-store reference)
    under the payload's key: the last reader in this process, `release`, `drop_request` and `close` free it."""

    def __init__(self) -> None:
        self._entries: dict[str, HeldPayload] = {}
        self._keys_by_request: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def _hold(self, key: str, request_id: str, held: Any, num_readers: int) -> None:
        with self._lock:
            self._entries[key] = HeldPayload(request_id, held, num_readers)
            self._keys_by_request.setdefault(request_id, set()).add(key)

    def _take(self, key: str) -> Any:
        """One reader in this process takes the payload (the caller holds the lock); the last one frees it."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"payload {key} was already consumed or dropped")
        entry.readers_left -= 1
        if entry.readers_left <= 0:
            self._remove(key)
        return entry.held

    def _free(self, held: Any) -> None:
        """Free what one payload held (nothing to do by default: dropping the reference is enough)."""

    def release(self, handle: PayloadHandle) -> None:
        """The producer frees the payload after a reader in another process took it."""
        with self._lock:
            self._remove(handle.key)

    def drop_request(self, request_id: str) -> None:
        with self._lock:
            for key in list(self._keys_by_request.get(request_id, ())):
                self._remove(key)

    def close(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._remove(key)

    def __len__(self) -> int:
        return len(self._entries)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        keys = self._keys_by_request.get(entry.request_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_by_request[entry.request_id]
        self._free(entry.held)
