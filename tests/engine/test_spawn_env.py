"""Stages start side by side, each with its own environment for the processes it starts (`spawn_environ`): a
process keeps the environment it was started with, so no stage's process may see another stage's variables."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from vllm_omni.engine.spawn_env import spawn_environ

VAR = "VLLM_OMNI_TEST_SPAWN_ENV"


def _report(conn) -> None:
    """A stage process: reports the environment it was started with, then lives until its stage lets it go."""
    conn.send(os.environ.get(VAR))
    conn.recv()
    conn.close()


def _start_child(stage: int, spawned: list[threading.Event]) -> tuple[str | None, bool]:
    """What a stage start does in its thread: a process, then the wait for it to become ready (here: until the
    next stage has started its process, which it can only do if this stage no longer holds the environment)."""
    # Spawned, as the stage processes are: a fork from this thread would free the main thread's thread-locals in
    # the child, where PyAV's cached video reformatter (an earlier test's, in the main thread) waits forever for
    # its slice threads.
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=_report, args=(child,))
    proc.start()
    child.close()  # the child's end lives in the child alone: its death reads as EOF here
    spawned[stage].set()
    assert parent.poll(60), f"stage {stage}'s process never reported"
    seen = parent.recv()
    overlapped = stage + 1 == len(spawned) or spawned[stage + 1].wait(30)
    parent.send("bye")
    proc.join(10)
    return seen, overlapped


async def _stage(stage: int, spawned: list[threading.Event], windows: list) -> tuple[str | None, bool]:
    loop = asyncio.get_running_loop()
    async with spawn_environ({VAR: str(stage)}) as started:
        opened = time.monotonic()
        work = loop.run_in_executor(None, _start_child, stage, spawned)
        await started(work, 1)
        windows.append((opened, time.monotonic()))
    return await work


def test_each_stage_process_sees_its_own_environment_and_starts_overlap(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)

    async def main():
        windows: list = []
        spawned = [threading.Event() for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:
            asyncio.get_running_loop().set_default_executor(pool)
            results = await asyncio.gather(*(_stage(i, spawned, windows) for i in range(3)))
        return results, windows

    results, windows = asyncio.run(main())
    assert [seen for seen, _ in results] == ["0", "1", "2"]
    assert VAR not in os.environ
    # One stage at a time held the environment, each only until its process existed, not until its start ended:
    # every start still waiting for "ready" saw the next stage start its process.
    windows.sort()
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:], strict=False))
    assert all(overlapped for _, overlapped in results)


def test_a_start_that_starts_no_process_releases_the_environment_when_it_ends(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)

    async def stage(value: str) -> None:
        async with spawn_environ({VAR: value}) as started:
            assert os.environ[VAR] == value
            await started(asyncio.sleep(0.01), 1)

    async def main():
        await asyncio.wait_for(asyncio.gather(stage("a"), stage("b")), timeout=5)

    asyncio.run(main())
    assert VAR not in os.environ
