"""A short soak of a live `vllm serve tiny/qwen-image --omni`: a few hundred image requests at concurrency 8,
every fourth one abandoned by its client mid-flight, then the server must be as it was.

What it pins: disconnects abort their work (the running gauge returns to 0 and a fresh request is served at
once), every kept request succeeds, and nothing leaks: the server tree's open fds, its processes (no zombies)
and /dev/shm segments are back to the baseline.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import pytest

from tests.entrypoints.leak_checks import orphan_segments, shm_segments
from tests.entrypoints.openai.live_server import QWEN_IMAGE_LONG

REQUESTS = 200
CONCURRENCY = 8
KEPT = {"prompt": "a red cube", "size": "32x32", "num_inference_steps": 2, "seed": 0}
ABANDONED = {"prompt": "a slow cube", "size": "64x64", "num_inference_steps": 100_000, "seed": 0}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(*QWEN_IMAGE_LONG)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _fds(pid: int) -> int:
    return sum(p.num_fds() for p in _tree(pid) if p.is_running())


def _zombies(pid: int) -> list[int]:
    return [p.pid for p in _tree(pid) if p.status() == psutil.STATUS_ZOMBIE]


async def _soak(url: str) -> tuple[int, int, list[str]]:
    kept_ok, abandoned, failures = 0, 0, []
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(i: int) -> None:
            nonlocal kept_ok, abandoned
            async with gate:
                if i % 4 == 3:
                    try:
                        await client.post("/v1/images/generations", json=ABANDONED, timeout=0.3)
                        failures.append(f"{i}: abandoned request finished")
                    except httpx.TimeoutException:
                        abandoned += 1
                    return
                res = await client.post("/v1/images/generations", json=KEPT)
                if res.status_code == 200:
                    kept_ok += 1
                else:
                    failures.append(f"{i}: {res.status_code} {res.text[:200]}")

        await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    return kept_ok, abandoned, failures


def test_soak_with_disconnects_leaves_no_residue(server):
    httpx.post(f"{server.url}/v1/images/generations", json=KEPT, timeout=60).raise_for_status()  # warm
    shm_before, fds_before = shm_segments(), _fds(server.proc.pid)
    start = time.monotonic()
    kept_ok, abandoned, failures = asyncio.run(_soak(server.url))
    assert not failures, failures[:5]
    assert kept_ok == REQUESTS - REQUESTS // 4 and abandoned == REQUESTS // 4
    assert time.monotonic() - start < 300

    deadline = time.monotonic() + 10
    while server.metric("vllm_omni:requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric("vllm_omni:requests_running") == 0
    t0 = time.monotonic()
    httpx.post(f"{server.url}/v1/images/generations", json=KEPT, timeout=10).raise_for_status()
    assert time.monotonic() - t0 < 5, "a fresh request waited behind abandoned work"
    assert not _zombies(server.proc.pid)
    assert not orphan_segments(shm_before)
    assert _fds(server.proc.pid) <= fds_before + 16
