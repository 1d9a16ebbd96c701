"""Leak checks that tolerate other test processes on the same machine.

A leaked shared-memory segment is one that still exists but no live process maps; a leaked process is a
child of ours in our session other than Python's multiprocessing helpers (its resource tracker, and the forkserver
that tests/diffusion/distributed/parallel_harness.py starts its ranks from). Live servers
(tests/entrypoints/openai/live_server.py) run in sessions of their own and are checked by their fixtures: one that
modules share (tests/conftest.py's `shared_server`) is still running while later modules check their engines.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil


def multiprocessing_helper(proc: psutil.Process) -> bool:
    """Python's resource tracker or forkserver: they live as long as the process that started them. The processes
    the forkserver forks have its command line too: it is the one whose parent's differs."""
    cmdline = " ".join(proc.cmdline())
    if "resource_tracker" in cmdline:
        return True
    return "multiprocessing.forkserver" in cmdline and "multiprocessing.forkserver" not in " ".join(
        proc.parent().cmdline())


def engine_children() -> list[str]:
    out = []
    session = os.getsid(0)
    for child in psutil.Process().children(recursive=True):
        try:
            if os.getsid(child.pid) != session or multiprocessing_helper(child):
                continue
            out.append(" ".join(child.cmdline()))
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return out


def shm_segments() -> set[str]:
    """Shared-memory segments (POSIX semaphores, `sem.*`, are multiprocessing locks, not payloads)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def orphan_segments(before: set[str]) -> set[str]:
    """Segments created since `before` that exist but are mapped by no live process."""
    new = shm_segments() - before
    if not new:
        return set()
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        mapped.update(name for name in new if f"/dev/shm/{name}" in text)
    return {name for name in new if name not in mapped and (Path("/dev/shm") / name).exists()}


def wait_until_clean(before: set[str], timeout: float = 20.0) -> tuple[list[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children, orphans = engine_children(), orphan_segments(before)
        if not children and not orphans:
            return children, orphans
        time.sleep(0.2)
    return engine_children(), orphan_segments(before)
