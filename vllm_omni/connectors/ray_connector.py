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

from dataclasses import dataclass

from vllm_omni.connectors.base import HeldPayloads, PayloadHandle, StagePayload

_GET_TIMEOUT_S = 60.0


@dataclass
class ObjectStoreStats:
    """What went through the object store from this connector (the producer's side) and into it (readers)."""

    payloads_put: int = 0
    bytes_put: int = 0
    """Tensor bytes put (the metadata, e.g. token ids or bytes in stage data, is not counted)."""
    payloads_got: int = 0


class RayObjectStoreConnector(HeldPayloads):
    def __init__(self, address: str | None = None, get_timeout_s: float = _GET_TIMEOUT_S) -> None:
        """Joins the Ray cluster at `address` (as `--ray-address`) unless this process already has."""
        from vllm_omni.diffusion.executor.ray_cluster import connect

        connect(address)
        super().__init__()
        self.get_timeout_s = get_timeout_s
        self.stats = ObjectStoreStats()

    def put(self, request_id: str, src_stage: int, dst_stage: int, payload: StagePayload,
            num_readers: int = 1, chunk: int | None = None) -> PayloadHandle:
        import ray

        key = self.make_key(request_id, src_stage, dst_stage, chunk)
        tensors = {name: tensor.detach().cpu() for name, tensor in payload.tensors.items()}
        ref = ray.put(StagePayload(metadata=dict(payload.metadata), tensors=tensors))
        self._hold(key, request_id, ref, num_readers)
        with self._lock:
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
                self._take(handle.key)
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


def _worker_id() -> str:
    import ray

    return ray.get_runtime_context().get_worker_id()
