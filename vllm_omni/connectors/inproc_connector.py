"""Connector for stages in the same process: the payload object itself is handed over (zero copy)."""

from __future__ import annotations

import threading

from vllm_omni.connectors.base import OmniConnector, PayloadHandle, StagePayload


class InProcConnector(OmniConnector):
    def __init__(self) -> None:
        self._entries: dict[str, tuple[StagePayload, int]] = {}
        self._keys_by_request: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def put(self, request_id: str, src_stage: int, dst_stage: int, payload: StagePayload,
            num_readers: int = 1, chunk: int | None = None) -> PayloadHandle:
        key = self.make_key(request_id, src_stage, dst_stage, chunk)
        with self._lock:
            self._entries[key] = (payload, num_readers)
            self._keys_by_request.setdefault(request_id, set()).add(key)
        return PayloadHandle(key=key, request_id=request_id)

    def get(self, handle: PayloadHandle) -> StagePayload:
        with self._lock:
            if handle.key not in self._entries:
                raise KeyError(f"payload {handle.key} was already consumed or dropped")
            payload, readers = self._entries[handle.key]
            if readers <= 1:
                del self._entries[handle.key]
                self._keys_by_request.get(handle.request_id, set()).discard(handle.key)
            else:
                self._entries[handle.key] = (payload, readers - 1)
        return payload

    def drop_request(self, request_id: str) -> None:
        with self._lock:
            for key in self._keys_by_request.pop(request_id, ()):
                self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._keys_by_request.clear()
