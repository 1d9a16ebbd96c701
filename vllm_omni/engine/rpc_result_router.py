"""Correlates results on the rpc queue with the callers waiting for them (one consumer thread)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Hashable
from typing import Any

from vllm_omni.engine.messages import ErrorMessage

_STOP = object()


class _Waiter:
    def __init__(self) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=1)

    def put(self, item: Any) -> None:
        with contextlib.suppress(queue.Full):  # a late duplicate; the first answer wins
            self._q.put_nowait(item)

    def get(self, timeout: float | None = None) -> Any:
        """The result; raises `queue.Empty` on timeout, RuntimeError if the router closed."""
        item = self._q.get(timeout=timeout)
        if item is _STOP:
            raise RuntimeError("RPC result router closed before a result arrived")
        return item


class RpcResultRouter:
    """Reads `source_queue` (a thread-safe queue of result messages) and wakes the registered waiter.

    Fatal `ErrorMessage`s are broadcast to every waiter; uncorrelated non-fatal errors are dropped.
    """

    def __init__(self, source_queue: Any) -> None:
        self._source = source_queue
        self._waiters: dict[Hashable, _Waiter] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="RpcResultRouter", daemon=True)
        self._thread.start()

    def register(self, key: Hashable) -> _Waiter:
        waiter = _Waiter()
        with self._lock:
            if self._closed:
                waiter.put(_STOP)
            self._waiters[key] = waiter
        return waiter

    def unregister(self, key: Hashable) -> None:
        with self._lock:
            self._waiters.pop(key, None)

    def _run(self) -> None:
        while True:
            msg = self._source.get()
            if msg is _STOP or self._closed:
                return
            key = getattr(msg, "rpc_correlation_key", None)
            with self._lock:
                if key is not None:
                    waiter = self._waiters.pop(key, None)
                    if waiter is not None:
                        waiter.put(msg)
                elif isinstance(msg, ErrorMessage) and msg.fatal:
                    for waiter in self._waiters.values():
                        waiter.put(msg)
                    self._waiters.clear()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for waiter in self._waiters.values():
                waiter.put(_STOP)
            self._waiters.clear()
        self._source.put(_STOP)
        self._thread.join(timeout=2.0)


class CorrelatedRpcClient:
    """Send a message on the request queue and wait, with a timeout, for the result with the same key."""

    def __init__(self, request_q: Any, rpc_q: Any) -> None:
        self._request_q = request_q
        self._router = RpcResultRouter(rpc_q)

    def execute(self, key: Hashable, msg: Any, *, timeout: float | None, timeout_message: str,
                block_on_submit: bool = True) -> Any:
        waiter = self._router.register(key)
        try:
            if block_on_submit:
                self._request_q.put(msg, timeout=timeout)
            else:
                self._request_q.put_nowait(msg)
            return waiter.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(timeout_message) from None
        except queue.Full:
            raise TimeoutError(timeout_message) from None
        finally:
            self._router.unregister(key)

    def close(self) -> None:
        self._router.close()
