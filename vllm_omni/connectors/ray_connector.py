"""Connector over Ray's object store, for an edge whose two stages run on different nodes of a Ray cluster.

`put` stores the payload once in the producer's node store (`ray.put`; tensors moved to CPU first, so a reader
without the producer's device can take them) and the handle carries its `ObjectRef`. A `get` in any process of
the cluster, on any node, fetches it: Ray copies the object between the nodes' stores, the one network
transfer, and unpickles fresh (writable) tensors. The handle travels between processes the way Ray tracks
references: as (part of) an argument or return value of a Ray task or actor call, which makes the reader a
borrower that keeps the object alive until it is done with it. The producer's own reference is dropped after
the last `get` in its process, on `release` (a reader in another process took it), on `drop_request` (abort,
failure) or on `close`; Ray frees the object once no process references it, so nothing outlives the request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm_omni.connectors.base import OmniConnector, PayloadHandle, StagePayload

_GET_TIMEOUT_S = 60.0


@dataclass
class ObjectStoreStats:
    """What went through the object store from this connector (the producer's side) and into it (readers)."""

    payloads_put: int = 0
    bytes_put: int = 0
    """Tensor bytes put (the metadata, well under 1 KiB a payload, is not counted)."""
    payloads_got: int = 0


@dataclass
class _Entry:
    request_id: str
    ref: Any
    readers_left: int


class RayObjectStoreConnector(OmniConnector):
    def __init__(self, address: str | None = None, get_timeout_s: float = _GET_TIMEOUT_S) -> None:
        """Joins the Ray cluster at `address` (as `--ray-address`) unless this process already has."""
        from vllm_omni.diffusion.executor.ray_cluster import connect

        connect(address)
        self.get_timeout_s = get_timeout_s
        self.stats = ObjectStoreStats()
        self._entries: dict[str, _Entry] = {}
        self._keys_by_request: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def put(self, request_id: str, src_stage: int, dst_stage: int, payload: StagePayload,
            num_readers: int = 1, chunk: int | None = None) -> PayloadHandle:
        import ray

        key = self.make_key(request_id, src_stage, dst_stage, chunk)
        tensors = {name: tensor.detach().cpu() for name, tensor in payload.tensors.items()}
        ref = ray.put(StagePayload(metadata=dict(payload.metadata), tensors=tensors))
        with self._lock:
            self._entries[key] = _Entry(request_id, ref, num_readers)
            self._keys_by_request.setdefault(request_id, set()).add(key)
            self.stats.payloads_put += 1
            self.stats.bytes_put += sum(t.numel() * t.element_size() for t in tensors.values())
        return PayloadHandle(key=key, request_id=request_id, ref=ref, producer=_worker_id())

    def get(self, handle: PayloadHandle) -> StagePayload:
        """The payload, from this node's store (fetched there from the producer's node first). In the producer's
        process a handle already consumed or dropped raises KeyError, as on one host; a payload whose producer
        died, or that did not arrive within `get_timeout_s`, raises RuntimeError naming it."""
        import ray

        if handle.ref is None:
            raise KeyError(f"payload {handle.key} was not put through Ray's object store")
        if handle.producer == _worker_id():
            with self._lock:
                entry = self._entries.get(handle.key)
                if entry is None:
                    raise KeyError(f"payload {handle.key} was already consumed or dropped")
                entry.readers_left -= 1
                if entry.readers_left <= 0:
                    self._remove(handle.key)
        try:
            payload = ray.get(handle.ref, timeout=self.get_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"payload {handle.key} did not arrive from Ray's object store within "
                               f"{self.get_timeout_s:.0f} s") from None
        except ray.exceptions.ObjectLostError as exc:  # its owner (the producing process) or every copy is gone
            raise RuntimeError(f"payload {handle.key} is lost from Ray's object store: "
                               f"{' '.join(str(exc).split())[:300]}") from None
        with self._lock:
            self.stats.payloads_got += 1
        return payload

    def release(self, handle: PayloadHandle) -> None:
        """The producer drops its reference after a reader in another process took the payload."""
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


def _worker_id() -> str:
    import ray

    return ray.get_runtime_context().get_worker_id()
