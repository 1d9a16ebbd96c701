"""The environment a stage's processes start with: this process's own at the moment each one is started, so a
stage sets its variables (devices, OpenMP CPU set) only while it starts its processes, one stage at a time."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable


@contextlib.contextmanager
def stage_environ(env: dict[str, str]):
    """`env` in this process's environment inside the block, restored after it."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_SPAWN_LOCK = threading.Lock()
"""Held by the one stage that is starting its processes under its environment (`spawn_environ`)."""
_SPAWN_POLL_S = 0.01

ProcessesStarted = Callable[[Awaitable, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def spawn_environ(env: dict[str, str]) -> AsyncIterator[ProcessesStarted]:
    """`env` (a replica's devices, its OpenMP CPU set) in this process's environment while the caller starts that
    replica's processes, which keep the environment they were started with. Stages start (and restart) side by
    side, so one at a time: another stage waits here until this one's processes exist, not until they are ready.

    Yields `started(work, count)`: returns once `work` (the start running in a thread) has started `count` new
    multiprocessing children, or has ended."""
    while not _SPAWN_LOCK.acquire(blocking=False):  # not a blocking acquire: the holder may be on this loop
        await asyncio.sleep(_SPAWN_POLL_S)
    try:
        before = {child.pid for child in multiprocessing.active_children()}

        async def started(work: Awaitable, count: int) -> None:
            work = asyncio.ensure_future(work)
            while not work.done():
                if len({child.pid for child in multiprocessing.active_children()} - before) >= count:
                    return
                await asyncio.wait({work}, timeout=_SPAWN_POLL_S)

        with stage_environ(env):
            yield started
    finally:
        _SPAWN_LOCK.release()
