"""Live `vllm serve tiny/qwen2 --omni --pipeline-config prompt_rewriter_to_qwen_image.yaml --deploy-config
shm_connector` (issue 18): the multi-stage YAML pipeline `Omni` runs offline, served online.

Pins: the server runs the YAML's graph (AR tiny Qwen2 -> diffusion tiny Qwen-Image, payloads over shared
memory), not the model's own one-stage topology; the official `openai` client gets a 64x64 image from
`images.generate` and, since stage 0 is an AR stage, from `chat.completions` too (an `image_url` part);
the diffusion stage's size rule applies to the pipeline's second stage; `/metrics` keeps each stage's durations
under its `stage_id` and has vLLM's `vllm:*` series of the AR stage's replica.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.entrypoints.openai.live_server import LiveServer

MODEL = "tiny/qwen2"
PIPELINE = Path(__file__).parents[3] / "examples/offline_inference/pipelines/prompt_rewriter_to_qwen_image.yaml"
FAST = {"num_inference_steps": 2, "seed": 0}


@pytest.fixture(scope="module")
def server(stop_later):
    srv = LiveServer(MODEL, "--pipeline-config", str(PIPELINE), "--deploy-config", "shm_connector",
                     "--gpu-memory-utilization", "0.15", "--dtype", "float32", "--enforce-eager")
    yield srv
    stop_later(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)


def test_images_generate_through_both_stages(client, server):
    out = client.images.generate(model=MODEL, prompt="a cat on a chair", size="64x64", extra_body=FAST)
    image = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
    assert image.size == (64, 64)
    assert server.metric("vllm_omni:stage_duration_seconds_count", stage="llm") >= 1
    assert server.metric("vllm_omni:stage_duration_seconds_count", stage="diffusion") >= 1
    # kept per stage: the rewriter's time is stage 0's, the image stage's phases are stage 1's
    assert server.metric("vllm_omni:stage_duration_seconds_count", stage="llm", stage_id="0", stage_type="llm") >= 1
    assert server.metric("vllm_omni:stage_duration_seconds_count", stage="diffusion.denoise", stage_id="1",
                         stage_type="diffusion") >= 1
    # vLLM's own series of the AR stage's replica, labelled with it
    assert server.metric("vllm:request_success_total", stage_id="0", stage_type="llm", replica="0") >= 1


def test_chat_answers_with_the_image(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a red cube"}],
                                          max_tokens=8, extra_body={"size": "64x64", **FAST})
    parts = chat.choices[0].message.content
    assert isinstance(parts, list) and parts[0]["type"] == "image_url", parts
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")


def test_the_diffusion_stage_size_rule_applies(server):
    resp = httpx.post(f"{server.url}/v1/images/generations", timeout=30,
                      json={"prompt": "x", "size": "65x64", **FAST})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "size", resp.text
