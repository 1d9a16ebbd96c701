"""Live server on the tiny Qwen-Image-Edit checkpoint: `images.edit` (multipart upload) reaches the edit
pipeline; a request without its input image is a 400 from the pipeline. (Chat with an input image is pinned
by the contract tests: one more edit forward costs ~20 s on CPU.)"""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from tests.entrypoints.openai.live_server import LiveServer

MODEL = "tiny/qwen-image-edit"
FAST = {"num_inference_steps": 2, "seed": 0}


@pytest.fixture(scope="module")
def server(stop_later):
    srv = LiveServer(MODEL)
    yield srv
    stop_later(srv)


def png(size=(64, 64), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_images_edit(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    res = client.images.edit(model=MODEL, image=("in.png", png(), "image/png"), prompt="make it blue",
                             size="64x64", extra_body=FAST)
    out = Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json)))
    assert out.size == (64, 64)


def test_edit_needs_its_image(server):
    resp = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x", **FAST}, timeout=120)
    assert resp.status_code == 400, resp.text
    assert "image" in resp.json()["error"]["message"]
