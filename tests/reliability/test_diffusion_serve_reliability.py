"""`vllm serve ... --omni` with a busy diffusion worker: abort, worker death, shutdown, death of the server.

The abort and restart tests serve `FakeStepPipeline` (20 ms steps that check for aborts before each step,
as the native pipelines do) through `--model-class-name` on the tiny Qwen-Image checkpoint, so their timings
are the runtime's and not a model's; the SIGKILL test runs the real tiny Qwen-Image pipeline.

Pins: a client that gives up on a long request frees the worker at once (a 2-step request right after
completes within 2 s); a lone surrogate in chat content is a 400 and the worker lives on; kill -9 of the
worker fails its request with 503 within 1 s, /health says degraded, and the stage serves again
within 60 s without restarting the server, leaving no zombie, shm segment or socket directory; SIGTERM with a
busy worker exits within 15 s leaving nothing; so does a SIGTERM to the server's whole process group (systemd,
docker stop, `kill -TERM -PGID`: the worker may die first) in step mode, and no worker is restarted; after
SIGKILL of the server its workers are gone within 10 s.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.entrypoints.leak_checks import multiprocessing_helper, orphan_segments, shm_segments
from tests.entrypoints.openai.live_server import LiveServer

FAKE = "tests.diffusion.fake_pipelines:FakeStepPipeline"
IMAGES = "/v1/images/generations"
REPO = Path(__file__).resolve().parents[2]
LONG = ("--max-inference-steps", "100000")
"""Requests long enough to still be running when the test acts, whatever the machine's speed."""


def body(steps: int) -> dict:
    return {"prompt": "x", "size": "64x64", "num_inference_steps": steps}


def workers(srv: LiveServer) -> list[psutil.Process]:
    """The server's live diffusion workers (a worker killed a moment ago may be a zombie until reaped): the
    processes its diffusion cores started. A core is started by the server itself: forked at its entry, with the
    server's command line (`diffusion/core/prestart.py`), or from its forkserver (a second replica); a worker by a
    core, forked or from the core's forkserver (a restart). Processes are told apart by their place in the tree."""
    def starter(proc: psutil.Process) -> psutil.Process:
        parent = proc.parent()
        return parent.parent() if multiprocessing_helper(parent) else parent

    found = []
    for proc in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            if not multiprocessing_helper(proc) and starter(proc).pid != srv.proc.pid:
                found.append(proc)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found


def ipc_dirs(pid: int) -> set[str]:
    """The diffusion socket directories a process and its children (the diffusion core) have bound."""
    root = psutil.Process(pid)
    return {str(Path(c.laddr).parent) for proc in [root, *root.children(recursive=True)]
            for c in proc.net_connections(kind="unix") if "vllm_omni_ipc_" in (c.laddr or "")}


def post_in_background(srv: LiveServer, steps: int, timeout: float = 120) -> dict:
    result: dict = {}

    def run() -> None:
        start = time.monotonic()
        try:
            result["response"] = httpx.post(srv.url + IMAGES, json=body(steps), timeout=timeout)
        except httpx.HTTPError as exc:
            result["error"] = exc
        result["at"] = time.monotonic()
        result["took"] = result["at"] - start

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def wait_busy(srv: LiveServer) -> None:
    """Until the request is on the idle worker (running, then a moment to get inside the forward)."""
    deadline = time.monotonic() + 30
    while srv.metric("vllm_omni:requests_running") < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)
    time.sleep(1.0)


def gone(pid: int) -> bool:
    """Exited and reaped: a zombie still has a process entry."""
    return not psutil.pid_exists(pid)


@pytest.fixture(scope="module")
def fake_server():
    shm_before = shm_segments()
    with pytest.MonkeyPatch.context() as mp:  # the server's workers import the fake pipeline from tests/
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        srv = LiveServer("tiny/qwen-image", "--model-class-name", FAKE, *LONG)
    yield srv, shm_before
    srv.close()


def test_client_gone_frees_the_worker_at_once(fake_server):
    srv, _ = fake_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + IMAGES, json=body(1000), timeout=2.0)  # 20 s of work, abandoned after 2 s
    start = time.monotonic()
    resp = httpx.post(srv.url + IMAGES, json=body(2), timeout=30)
    assert resp.status_code == 200
    assert time.monotonic() - start < 2.0
    assert srv.metric("vllm_omni:engine_requests_total", outcome="aborted") == 1


def test_lone_surrogate_in_chat_fails_that_request_only(fake_server):
    srv, _ = fake_server
    (worker,) = workers(srv)
    raw = rb'{"messages": [{"role": "user", "content": "\ud800"}], "size": "64x64", "num_inference_steps": 2}'
    resp = httpx.post(srv.url + "/v1/chat/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert httpx.post(srv.url + IMAGES, json=body(2), timeout=30).status_code == 200
    assert workers(srv)[0].pid == worker.pid


def test_kill9_of_the_worker_fails_fast_and_the_stage_comes_back(fake_server):
    srv, shm_before = fake_server
    old_dirs = ipc_dirs(srv.proc.pid)
    errors_before = srv.metric("vllm_omni:engine_requests_total", outcome="error")
    pending = post_in_background(srv, 1000)
    wait_busy(srv)
    (worker,) = workers(srv)
    killed_at = time.monotonic()
    worker.kill()
    pending["thread"].join(30)
    assert pending["response"].status_code == 503, pending["response"].text
    assert pending["at"] - killed_at <= 1.0  # issue 13 acceptance; 0.2-0.4 s measured on a loaded 2-core box
    health = httpx.get(srv.url + "/health", timeout=10)
    assert health.status_code == 503 and "degraded" in health.json()["error"]["message"]
    deadline = killed_at + 60
    while httpx.get(srv.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the stage did not come back within 60 s"
        time.sleep(0.5)
    assert httpx.post(srv.url + IMAGES, json=body(2), timeout=30).status_code == 200
    assert gone(worker.pid), "the dead worker was not reaped"
    assert not any(os.path.exists(d) for d in old_dirs)
    assert not orphan_segments(shm_before)
    assert srv.metric("vllm_omni:engine_requests_total", outcome="error") == errors_before + 1


def assert_sigterm_busy_exits_within_15s_leaving_nothing(srv: LiveServer, shm_before: set[str], steps: int) -> None:
    dirs = ipc_dirs(srv.proc.pid)
    post_in_background(srv, steps)
    wait_busy(srv)
    (worker,) = workers(srv)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(timeout=30)
    assert time.monotonic() - start <= 15
    assert gone(worker.pid)
    assert not any(os.path.exists(d) for d in dirs)
    assert not orphan_segments(shm_before)


def test_sigterm_with_a_busy_worker_exits_within_15s_leaving_nothing(fake_server):
    srv, shm_before = fake_server
    assert_sigterm_busy_exits_within_15s_leaving_nothing(srv, shm_before, 5000)


def test_sigterm_with_a_busy_real_pipeline():
    """The native tiny Qwen-Image pipeline: stopped in time whether or not its denoise loop checks aborts."""
    shm_before = shm_segments()
    srv = LiveServer("tiny/qwen-image", *LONG)
    try:
        assert_sigterm_busy_exits_within_15s_leaving_nothing(srv, shm_before, 20_000)
    finally:
        srv.close()


def group_members(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of a process group: a child started after a snapshot of the tree counts too."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def test_group_sigterm_restarts_no_worker_and_leaves_no_process():
    """An idle server, as `diffusion_benchmark_serving.py --compare-modes` stops one after its run. Whether the
    core's loop sees its worker's death after its own SIGTERM depends on scheduling: before the fix, on a quiet
    machine (load average 2), the core restarted the worker in 3 runs of 3 (2 in step, 1 in request mode), then
    exited, leaving the new one behind, and this test fails without the fix at load average 4; at 17-30 the
    core's loop ended first and it passed (the engine-level contract is pinned in test_worker_reliability.py). A
    death seen before the core's handler ran began a restart (a new worker started, then stopped with the core):
    the restart now waits `_RESTART_GRACE_S` for a stop first.
    Step mode, where it was seen; request mode takes the same path: the restart decision and the core's signal
    handler do not depend on the mode."""
    shm_before = shm_segments()
    srv = LiveServer("tiny/qwen-image", "--step-execution")
    try:
        dirs = ipc_dirs(srv.proc.pid)
        tree = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
        assert len(tree) >= 3  # the server, its diffusion core, the worker
        start = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGTERM)
        srv.proc.wait(timeout=30)
        while group_members(srv.proc.pid):
            assert time.monotonic() - start < 15, f"still alive 15 s after SIGTERM: {group_members(srv.proc.pid)}"
            time.sleep(0.1)
        assert all(gone(proc.pid) or proc.status() == psutil.STATUS_ZOMBIE for proc in tree)
        assert "restarting the diffusion workers" not in srv.log.read_text()
        assert not any(os.path.exists(d) for d in dirs)
        assert not orphan_segments(shm_before)
    finally:
        srv.close()


def test_sigkill_of_the_server_takes_its_workers_along():
    shm_before = shm_segments()
    srv = LiveServer("tiny/qwen-image", *LONG)
    try:
        dirs = ipc_dirs(srv.proc.pid)
        post_in_background(srv, 20_000)
        wait_busy(srv)
        pids = [p.pid for p in workers(srv)]
        os.kill(srv.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not all(gone(pid) for pid in pids):
            assert time.monotonic() - killed_at < 10, "a worker outlived the server by 10 s"
            time.sleep(0.2)
        assert not any(os.path.exists(d) for d in dirs)
        assert not orphan_segments(shm_before)
    finally:
        srv.close()
