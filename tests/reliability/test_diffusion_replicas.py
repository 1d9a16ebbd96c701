"""`vllm serve ... --omni --data-parallel-size 2`: two diffusion replicas behind one server.

Pins: concurrent requests are spread over both replicas (the per-replica metric shows it); kill -9 of one
replica's worker fails only that replica's in-flight request (503 within 10 s) while the other replica keeps
answering and `/health` is 200 with a "degraded" body naming the stage; the replica restarts and the stage is
healthy again within 60 s. Steps are `FakeStepPipeline`'s (20 ms each), so timings are the runtime's.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.leak_checks import orphan_segments, shm_segments
from tests.entrypoints.openai.live_server import LiveServer
from tests.reliability.test_diffusion_serve_reliability import (
    FAKE,
    IMAGES,
    LONG,
    REPO,
    body,
    gone,
    post_in_background,
    workers,
)


@pytest.fixture(scope="module")
def replicated():
    shm_before = shm_segments()
    with pytest.MonkeyPatch.context() as mp:  # the server's workers import the fake pipeline from tests/
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        srv = LiveServer("tiny/qwen-image", "--model-class-name", FAKE, "--data-parallel-size", "2", *LONG)
    yield srv
    assert srv.close(), "the server left processes behind"
    assert not orphan_segments(shm_before)


def dispatched(srv: LiveServer) -> list[float]:
    return [srv.metric("vllm_omni:stage_replica_dispatched_requests", replica=str(r)) for r in range(2)]


def test_concurrent_requests_spread_over_both_replicas(replicated):
    srv = replicated
    assert len(workers(srv)) == 2
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: httpx.post(srv.url + IMAGES, json=body(20), timeout=60).status_code,
                              range(8)))
    assert codes == [200] * 8
    assert sum(dispatched(srv)) == 8 and min(dispatched(srv)) >= 2, dispatched(srv)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_kill9_of_one_replica_leaves_the_other_serving(replicated):
    srv = replicated
    first, second = post_in_background(srv, 250), post_in_background(srv, 250)  # 5 s each, one per replica
    deadline = time.monotonic() + 30
    while srv.metric("vllm_omni:requests_running") < 2:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.1)
    time.sleep(0.5)
    victim = workers(srv)[0]
    killed_at = time.monotonic()
    victim.kill()

    deadline = killed_at + 5  # the engine notices the death through the worker's sentinel
    while not (health := httpx.get(srv.url + "/health", timeout=10)).content:
        assert time.monotonic() < deadline, "/health never said degraded"
        time.sleep(0.05)
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    (stage,) = health.json()["stages"]
    assert sorted(stage["replicas"]) == ["restarting", "serving"]
    assert httpx.post(srv.url + IMAGES, json=body(2), timeout=60).status_code == 200  # the live replica

    for pending in (first, second):
        pending["thread"].join(30)
    codes = sorted(p["response"].status_code for p in (first, second))
    assert codes == [200, 503], [p["response"].text for p in (first, second)]
    failed = first if first["response"].status_code == 503 else second
    assert failed["at"] - killed_at <= 10

    deadline = killed_at + 60
    while httpx.get(srv.url + "/health", timeout=10).content:  # a plain 200 again: both replicas serve
        assert time.monotonic() < deadline, "the replica did not come back within 60 s"
        time.sleep(0.5)
    assert gone(victim.pid), "the dead worker was not reaped"
    assert srv.metric("vllm_omni:stage_replica_serving") == 2
