"""Live server in step mode with the priority policy (`vllm serve tiny/qwen-image --omni --step-execution
--max-num-seqs 1 --diffusion-scheduler-policy priority`), driven by the official `openai` client.

Pins: `images.generate(stream=True, partial_images=2)` yields two `image_generation.partial_image` events
(indices 0, 1) then `image_generation.completed` with the same image as the non-streamed request; a more urgent
request preempts a running one at a step boundary and finishes first while the preempted one still completes;
the scheduler series are on /metrics; bad scheduling / streaming fields are 400s naming the field.
"""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import openai
import pytest
from PIL import Image

from tests.entrypoints.openai.live_server import LiveServer

MODEL = "tiny/qwen-image"
FAST = {"num_inference_steps": 6, "seed": 3}


@pytest.fixture(scope="module")
def server(stop_later):
    srv = LiveServer(MODEL, "--step-execution", "--max-num-seqs", "1", "--diffusion-scheduler-policy", "priority",
                     "--max-inference-steps", "100000")
    yield srv
    stop_later(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_stream_partial_images(client):
    events = list(client.images.generate(model=MODEL, prompt="a red cube", size="32x32", stream=True,
                                         partial_images=2, extra_body=FAST))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(Image.open(io.BytesIO(base64.b64decode(e.b64_json))).size == (32, 32) for e in events)
    assert events[-1].size == "32x32" and events[-1].output_format == "png"
    plain = client.images.generate(model=MODEL, prompt="a red cube", size="32x32", extra_body=FAST)
    assert plain.data[0].b64_json == events[-1].b64_json


def test_an_urgent_request_preempts_a_running_one(client, server):
    preempted_before = server.metric("vllm_omni:diffusion_preemptions_total")
    stepping = threading.Event()
    done: dict[str, float] = {}

    def run_low() -> None:  # its first preview (a quarter in) says it is resident and stepping; 1500 steps are left
        for _event in client.images.generate(model=MODEL, prompt="low", size="32x32", stream=True, partial_images=3,
                                            extra_body={"num_inference_steps": 2000, "seed": 1, "priority": 5}):
            stepping.set()
        done["low"] = time.monotonic()

    low = threading.Thread(target=run_low)
    low.start()
    assert stepping.wait(120)
    client.images.generate(model=MODEL, prompt="urgent", size="32x32",
                           extra_body={"num_inference_steps": 2, "seed": 1, "priority": 0})
    done["urgent"] = time.monotonic()
    low.join(120)
    assert done["urgent"] < done["low"]
    assert server.metric("vllm_omni:diffusion_preemptions_total") >= preempted_before + 1
    assert server.metric("vllm_omni:diffusion_step_seconds_count", shape="32x32") >= 22
    assert server.metric("vllm_omni:diffusion_requests_running") == 0


@pytest.mark.parametrize("body,param", [
    ({"deadline_ms": 0}, "deadline_ms"),
    ({"deadline_ms": "soon"}, "deadline_ms"),
    ({"priority": 1.5}, "priority"),
    ({"partial_images": 4, "stream": True}, "partial_images"),
    ({"partial_images": 2}, "partial_images"),
    ({"stream": True, "n": 2}, "n"),
])
def test_bad_scheduling_and_streaming_fields(server, body, param):
    resp = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x", **FAST, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_no_5xx_recorded(server):
    assert server.metric("vllm_omni:http_requests_total", status="500") == 0
