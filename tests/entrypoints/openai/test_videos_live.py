"""Live `vllm serve tiny/wan2.1-t2v --omni`: the Videos API and the video WebSocket on the real engine.

Pins (issue #7 acceptance): the official `openai` client's create -> poll -> download works; `/v1/videos/sync`
returns an MP4 that PyAV decodes to the asked frame count and size; a `websockets` client gets `video.start`,
>= 2 binary chunks, `session.done`, and the chunks concatenate to the whole clip; closing the socket while the
engine works aborts the request (running gauge back to 0, abort counted) and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest
from websockets.sync.client import connect

from tests.entrypoints.openai.live_server import WAN_T2V_LONG
from vllm_omni.diffusion.video_utils import decode_mp4

MODEL = WAN_T2V_LONG[0]
FAST = {"num_frames": 9, "num_inference_steps": 2, "seed": 0}
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(*WAN_T2V_LONG)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_openai_client_create_poll_download(client):
    job = client.videos.create(model=MODEL, prompt="A cat walks on the grass.", size="48x32", extra_body=FAST)
    assert job.status == "queued" and job.size == "48x32"
    deadline = time.monotonic() + 120
    while job.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = client.videos.retrieve(job.id)
    assert job.status == "completed", job.error
    assert job.model_extra["cache"]["quality"] == "lossless"  # vllm-omni extension: what the cache ran
    frames = decode_mp4(client.videos.download_content(job.id).read())
    assert frames.shape == (9, 32, 48, 3)
    assert job.id in [v.id for v in client.videos.list(limit=5).data]


def test_sync_route_returns_decodable_mp4(server):
    resp = httpx.post(f"{server.url}/v1/videos/sync", timeout=120,
                      json={"prompt": "Ocean waves.", "size": "32x32", **FAST, "num_frames": 13})
    assert resp.status_code == 200 and resp.headers["content-type"] == "video/mp4"
    assert decode_mp4(resp.content).shape == (13, 32, 32, 3)
    bad = httpx.post(f"{server.url}/v1/videos/sync", timeout=30, json={"prompt": "x", "size": "40x32"})
    assert bad.status_code == 400 and "width" in bad.json()["error"]["message"]


@pytest.mark.parametrize("body,param", [({**FAST, "size": "65x65"}, "size"), ({**FAST, "seed": 2**64}, "seed"),
                                        ({"num_inference_steps": 2, "seconds": 1e300}, "seconds")])
def test_invalid_job_refused_before_queuing(server, body, param):
    """D18 (issue 13): each was 200 `queued`, then `failed`; now a 400 naming the field and no job, on the
    async route, /sync and the WebSocket alike (Wan's size rule is read from the checkpoint's configs)."""
    jobs = httpx.get(f"{server.url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"]
    for path in ("/v1/videos", "/v1/videos/sync"):
        resp = httpx.post(f"{server.url}{path}", json={"prompt": "x", **body}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert httpx.get(f"{server.url}/v1/videos", params={"limit": 100}, timeout=30).json()["data"] == jobs
    with connect(server.url.replace("http", "ws") + "/v1/realtime/video", open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.start", "prompt": "x", "sampling_params": body}))
        msg = json.loads(ws.recv(timeout=30))
    assert (msg["type"], msg["param"]) == ("error", param), msg


def test_websocket_streams_chunks_while_the_clip_decodes(server):
    """17 frames = 5 latent frames = 5 decoded chunks; the first fragment must reach the client before the
    engine's final output (the whole decoded clip) reached the server, i.e. before the full decode finished."""
    url = server.url.replace("http", "ws") + "/v1/realtime/video"
    with connect(url, open_timeout=30, close_timeout=10) as ws:
        t0 = time.monotonic()
        ws.send(json.dumps({"type": "session.start", "prompt": "A red car.",
                            "sampling_params": {**FAST, "num_frames": 17, "size": "96x64"}}))
        start = json.loads(ws.recv(timeout=120))
        assert start["type"] == "video.start" and start["num_frames"] == 17 and start["fps"] == 16
        chunks, arrivals, metas = [], [], []
        while True:
            msg = json.loads(ws.recv(timeout=60))
            if msg["type"] == "session.done":
                break
            assert msg["type"] == "video.chunk_metadata", msg
            metas.append(msg)
            chunks.append(ws.recv(timeout=60))
            arrivals.append(time.monotonic() - t0)
        timing = msg["timing"]
        logger.info("first binary chunk at %.3f s (client clock); chunks at %s; final output reached the server "
                    "at %.3f s; timing %s", arrivals[0], [f"{a:.3f}" for a in arrivals], timing["final_output_s"],
                    timing)
    assert msg["cache"]["quality"] == "lossless" and msg["cache"]["reused_steps"] == 0  # no quality: uncached
    assert len(chunks) == 5 and all(isinstance(c, bytes) for c in chunks)
    assert [(m["frame_start"], m["frame_end"]) for m in metas] == [(0, 1), (1, 5), (5, 9), (9, 13), (13, 17)]
    # The client's clock started before the server's, so this is the stricter comparison.
    assert arrivals[0] < timing["final_output_s"], (arrivals, timing)
    assert decode_mp4(b"".join(chunks)).shape == (17, 64, 96, 3)


def test_job_progress_follows_the_denoise_steps(client):
    job = client.videos.create(model=MODEL, prompt="A slow boat.", size="96x64",
                               extra_body={**FAST, "num_frames": 17, "num_inference_steps": 30})
    seen = []
    deadline = time.monotonic() + 120
    while job.status not in ("completed", "failed") and time.monotonic() < deadline:
        job = client.videos.retrieve(job.id)
        seen.append(job.progress)
        time.sleep(0.02)
    logger.info("job progress values seen: %s", sorted(set(seen)))
    assert job.status == "completed" and job.progress == 100
    assert any(0 < p < 100 for p in seen), seen
    assert seen == sorted(seen)


def test_closing_the_socket_aborts_the_request(server):
    aborted_before = server.metric("vllm_omni:engine_requests_total", outcome="aborted")
    url = server.url.replace("http", "ws") + "/v1/realtime/video"
    with connect(url, open_timeout=30) as ws:
        # Long enough (seconds even on an idle machine) that the running gauge is seen before it would finish.
        ws.send(json.dumps({"type": "session.start", "prompt": "A slow one.",
                            "sampling_params": {"num_frames": 33, "num_inference_steps": 800, "size": "64x48"}}))
        deadline = time.monotonic() + 30
        while server.metric("vllm_omni:requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.metric("vllm_omni:requests_running") == 1
    deadline = time.monotonic() + 30
    while server.metric("vllm_omni:requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("vllm_omni:requests_running") == 0
    assert server.metric("vllm_omni:engine_requests_total", outcome="aborted") == aborted_before + 1
    # The engine drops the aborted request and keeps serving.
    resp = httpx.post(f"{server.url}/v1/videos/sync", timeout=300, json={"prompt": "after", **FAST,
                                                                        "size": "32x32"})
    assert resp.status_code == 200 and decode_mp4(resp.content).shape[0] == 9


@pytest.mark.parametrize("streamed", [False, True], ids=["jobs_api", "websocket"])
def test_playground_video_form_plays_in_chromium(server, streamed):
    """The playground's video form (tests/entrypoints/openai/test_playground_browser.py has the others): the
    jobs API with its progress bar, or the WebSocket's fragments; either way a clip the browser decodes."""
    from selenium.webdriver.common.by import By

    from tests.entrypoints.openai.browser import chromium, fill, screenshot, wait_for

    with chromium() as driver:
        driver.get(server.url + "/playground")
        fill(driver, "video-size", "48x32")
        fill(driver, "video-frames", "9")
        fill(driver, "video-steps", "2")
        if streamed:
            driver.find_element(By.ID, "video-stream").click()
        driver.find_element(By.ID, "video-send").click()
        size = wait_for(driver, "(() => { const v = document.getElementById('video-output');"
                                " return !v.hidden && v.readyState >= 1 ? [v.videoWidth, v.videoHeight, v.duration]"
                                " : null; })()")
        screenshot(driver, f"playground_video_{'websocket' if streamed else 'jobs'}")
        width, height, duration = size
        assert (width, height) == (48, 32) and duration > 0
        assert driver.find_element(By.ID, "video-progress").get_attribute("value") == "100"
        info = driver.find_element(By.ID, "video-info").text
        assert ("streamed" in info) if streamed else (info == "completed")
