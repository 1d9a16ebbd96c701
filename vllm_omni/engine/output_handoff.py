"""How the orchestrator's outputs reach the frontend: in batches, one cross-thread wake-up per batch.

The orchestrator runs on its own thread's event loop, where each AR stage's vLLM `AsyncLLM` hands it one
engine step's outputs for all running requests within one loop iteration. A thread-safe queue with an item per
output wakes the frontend's loop once per token per request (a self-pipe write and read, lock hand-offs
between the two threads); that was most of `--omni`'s extra CPU per streamed token. Here the outputs put during
one orchestrator loop iteration travel together: one `call_soon_threadsafe` per batch to an event-loop
subscriber (`AsyncOmni`), or item by item to a blocking reader (`Omni`, which asks for final outputs only).
While the subscriber's loop has not yet taken the last batch (it is busy, e.g. writing HTTP responses), later
batches join it instead of waking that loop again. Order is kept and no output is merged into another.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from vllm_omni.logger import init_logger

logger = init_logger(__name__)

BatchSink = Callable[[list[Any]], None]
"""Called on the subscriber's loop with the outputs of one orchestrator loop iteration, in order."""


class OutputHandOff:
    def __init__(self) -> None:
        self._pending: list[Any] = []
        self._blocking: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sink: tuple[asyncio.AbstractEventLoop, BatchSink] | None = None
        self._unread: list[Any] | None = None
        """Sent to the subscriber and not yet taken by its loop (later batches join it)."""
        self._lock = threading.Lock()

    # ---- orchestrator side (its loop's thread) -----------------------------------------------------------
    def put_nowait(self, item: Any) -> None:
        """Queue `item`; the batch goes out when the orchestrator's loop finishes its current iteration."""
        self._pending.append(item)
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what is pending now (also called directly when the orchestrator's loop is about to end)."""
        batch, self._pending = self._pending, []
        if not batch:
            return
        sink = self._sink
        if sink is None:
            for item in batch:
                self._blocking.put(item)
            return
        loop, deliver = sink
        with self._lock:
            closed = loop.is_closed()
            if closed:  # nobody is left to read these (nor what the closed loop did not take)
                self._unread = None
            elif self._unread is not None:
                self._unread.extend(batch)
                return
            else:
                self._unread = batch
        if not closed:
            try:  # outside the lock: the subscriber's loop may take it at once
                loop.call_soon_threadsafe(self._take, deliver)
                return
            except RuntimeError:  # closed just now
                with self._lock:
                    self._unread = None
        logger.debug("[OutputHandOff] dropped %d output(s): the subscriber's loop is closed", len(batch))

    def _take(self, deliver: BatchSink) -> None:
        with self._lock:
            batch, self._unread = self._unread, None
        deliver(batch)

    # ---- frontend side -----------------------------------------------------------------------------------
    def subscribe(self, loop: asyncio.AbstractEventLoop, deliver: BatchSink) -> None:
        """Send every later batch to `deliver` on `loop` (one subscriber: the frontend bound to that loop, which
        calls this from that loop). What was sent before goes to `deliver` at once, ahead of any later batch."""
        self._sink = (loop, deliver)
        early = []
        while not self._blocking.empty():
            early.append(self._blocking.get_nowait())
        if early:
            deliver(early)

    def get(self, timeout: float | None = None) -> Any:
        """The next output for a blocking reader (no subscriber); raises `queue.Empty` after `timeout` s."""
        return self._blocking.get(timeout=timeout)
