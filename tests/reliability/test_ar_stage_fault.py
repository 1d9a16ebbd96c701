"""`vllm serve tiny/qwen2 --omni` whose EngineCore is killed mid-request (issue 13, repro D17).

Pins: kill -9 of the AR stage's EngineCore fails the running (and queued) chat completions with 503 within
a few seconds and counts them as `error`; /health says degraded while the stage re-creates its AsyncLLM and
200 within 60 s; a chat completion succeeds after, on a new EngineCore; the dead EngineCore and its worker
are reaped (no zombie) and no shared-memory segment is left that no live process maps.
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from tests.entrypoints.leak_checks import orphan_segments, shm_segments
from tests.entrypoints.openai.live_server import LiveServer

CHAT = "/v1/chat/completions"


def chat(max_tokens: int) -> dict:
    return {"model": "tiny/qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "ignore_eos": True}


def engine_processes(srv: LiveServer) -> dict[str, psutil.Process]:
    """The server's live EngineCore and worker, by vLLM's process title."""
    found = {}
    for proc in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            name = proc.name()
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
        if name in ("VLLM::EngineCore", "VLLM::Worker"):
            found[name] = proc
    return found


def gone(proc: psutil.Process) -> bool:
    """Exited and reaped: a zombie still has a process entry."""
    try:
        return proc.status() == psutil.STATUS_DEAD
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def server():
    shm_before = shm_segments()
    srv = LiveServer("tiny/qwen2", "--gpu-memory-utilization", "0.05", "--enforce-eager",
                     "--max-num-seqs", "1")
    yield srv, shm_before
    srv.close()


def test_kill9_of_the_engine_core_fails_fast_and_the_stage_comes_back(server):
    srv, shm_before = server
    errors_before = srv.metric("vllm_omni:engine_requests_total", outcome="error")
    # One sequence at a time (--max-num-seqs 1): four 2000-token requests keep the tiny model busy long
    # enough to be killed in the middle; those still running or queued then fail with 503.
    results: list[dict] = [{} for _ in range(4)]

    def run(result: dict) -> None:
        result["response"] = httpx.post(srv.url + CHAT, json=chat(2000), timeout=120)
        result["at"] = time.monotonic()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in results]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # inside the first one (the server is too busy to answer /metrics in between)
    old = engine_processes(srv)
    core = old["VLLM::EngineCore"]
    killed_at = time.monotonic()
    core.kill()
    for thread in threads:
        thread.join(30)
    failed = [r for r in results if r["response"].status_code != 200]
    assert failed, "every request finished before the kill"
    for r in failed:
        assert r["response"].status_code == 503, r["response"].text
        assert r["at"] - killed_at <= 5.0
    health = httpx.get(srv.url + "/health", timeout=10)
    assert health.status_code == 503 and "degraded" in health.json()["error"]["message"], health.text
    while httpx.get(srv.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < killed_at + 60, "the stage did not come back within 60 s"
        time.sleep(0.5)
    resp = httpx.post(srv.url + CHAT, json=chat(4), timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]
    assert engine_processes(srv)["VLLM::EngineCore"].pid != core.pid
    assert all(gone(p) for p in old.values()), "the dead EngineCore or its worker was not reaped"
    assert not orphan_segments(shm_before)
    assert srv.metric("vllm_omni:engine_requests_total", outcome="error") == errors_before + len(failed)
