"""Abort stops the work of the real tiny pipelines, through every way a client can give up (issue 13).

What it pins, on `vllm serve tiny/qwen-image --omni` and `vllm serve tiny/wan2.1-t2v --omni` with the request at
the configured step maximum: a client that disconnects after 2 s (images), `DELETE /v1/videos/{id}` on a running
job, and a WebSocket closed mid-session each free the worker, so a 2-step request sent right after completes
within `freed_bound` of its own solo time (seconds, where the aborted request would take minutes); the worker
keeps its pid (nothing was restarted to get there). A prompt over the text encoder's token limit is a 400 naming
`prompt`.
"""

from __future__ import annotations

import json
import time

import httpx
import psutil
import pytest
from websockets.sync.client import connect

from tests.entrypoints.leak_checks import multiprocessing_helper
from tests.entrypoints.openai.live_server import QWEN_IMAGE_LONG, WAN_T2V_LONG, LiveServer

MAX_STEPS = 100_000
"""The servers' configured --max-inference-steps: minutes of work for the tiny models even on an idle machine."""
QUICK_IMAGE = {"prompt": "quick", "size": "32x32", "num_inference_steps": 2, "seed": 0}
QUICK_VIDEO = {"prompt": "quick", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 0}


def _worker_pids(srv: LiveServer) -> set[int]:
    """The server's stage processes and their workers (spawned, or forked from the server: `prestart.py`)."""
    return {p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)
            if not multiprocessing_helper(p)}


def freed_bound(solo: float) -> float:
    """How long a 2-step request may take after an abort: its solo time twice plus 5 s, as the test process shares
    the 2 CPUs with the suite's other worker (tools/test.sh), which makes one timed request vary by seconds. A worker
    still running the aborted request (MAX_STEPS) would take minutes."""
    return 5.0 + 2 * solo


def _timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def _wait_running(srv: LiveServer, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while srv.metric("vllm_omni:requests_running") != value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.metric("vllm_omni:requests_running") == value


@pytest.fixture(scope="module")
def image_server(shared_server):
    return shared_server(*QWEN_IMAGE_LONG)


@pytest.fixture(scope="module")
def video_server(shared_server):
    return shared_server(*WAN_T2V_LONG)


def _quick_image(srv: LiveServer) -> None:
    httpx.post(f"{srv.url}/v1/images/generations", json=QUICK_IMAGE, timeout=60).raise_for_status()


def _quick_video(srv: LiveServer) -> None:
    httpx.post(f"{srv.url}/v1/videos/sync", json=QUICK_VIDEO, timeout=60).raise_for_status()


def test_client_disconnect_frees_the_image_worker(image_server):
    _quick_image(image_server)  # warm
    solo = _timed(lambda: _quick_image(image_server))
    pids = _worker_pids(image_server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{image_server.url}/v1/images/generations", timeout=2.0,
                   json={"prompt": "long", "size": "64x64", "num_inference_steps": MAX_STEPS})
    after = _timed(lambda: _quick_image(image_server))
    assert after < freed_bound(solo), f"2-step request took {after:.2f} s after the disconnect (solo {solo:.2f} s)"
    _wait_running(image_server, 0)
    assert _worker_pids(image_server) == pids


def test_delete_of_a_running_video_job_frees_the_worker(video_server):
    _quick_video(video_server)  # warm
    solo = _timed(lambda: _quick_video(video_server))
    pids = _worker_pids(video_server)
    job = httpx.post(f"{video_server.url}/v1/videos", timeout=30,
                     json={"prompt": "long", "size": "64x64", "num_frames": 9, "num_inference_steps": MAX_STEPS})
    job.raise_for_status()
    _wait_running(video_server, 1)
    time.sleep(2.0)
    deleted = httpx.delete(f"{video_server.url}/v1/videos/{job.json()['id']}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    after = _timed(lambda: _quick_video(video_server))
    assert after < freed_bound(solo), f"2-step video took {after:.2f} s after the DELETE (solo {solo:.2f} s)"
    _wait_running(video_server, 0)
    assert _worker_pids(video_server) == pids


def test_closing_the_websocket_frees_the_worker(video_server):
    solo = _timed(lambda: _quick_video(video_server))
    url = video_server.url.replace("http", "ws") + "/v1/realtime/video"
    with connect(url, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.start", "prompt": "long",
                            "sampling_params": {"num_frames": 9, "num_inference_steps": MAX_STEPS,
                                                "size": "64x64"}}))
        _wait_running(video_server, 1)
        time.sleep(2.0)
    after = _timed(lambda: _quick_video(video_server))
    assert after < freed_bound(solo), f"2-step video took {after:.2f} s after the socket closed (solo {solo:.2f} s)"
    _wait_running(video_server, 0)


def test_a_prompt_over_the_text_encoders_limit_is_a_400(image_server):
    """D11's family: a 1 MiB prompt (under the body limit) is refused in the API process, quickly."""
    start = time.monotonic()
    resp = httpx.post(f"{image_server.url}/v1/images/generations", timeout=30,
                      json={"prompt": "a" * 2**20, "size": "32x32", "num_inference_steps": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    assert "text encoder reads at most 1024 tokens" in resp.json()["error"]["message"]
    assert time.monotonic() - start < 5
