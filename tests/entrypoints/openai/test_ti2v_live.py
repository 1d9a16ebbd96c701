"""Live `vllm serve tiny/wan2.2-ti2v-5b --omni --model-class-name WanImageToVideoPipeline`: Wan2.2-TI2V-5B's
image-to-video over HTTP (the checkpoint's model_index.json names the text-to-video class)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.entrypoints.openai.live_server import LiveServer
from vllm_omni.diffusion.video_utils import decode_mp4

MODEL = "tiny/wan2.2-ti2v-5b"


@pytest.fixture(scope="module")
def server(stop_later):
    srv = LiveServer(MODEL, "--model-class-name", "WanImageToVideoPipeline")
    yield srv
    stop_later(srv)


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_to_video_over_http(server):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 120, 3), dtype=np.uint8))
    body = {"prompt": "A dog runs.", "size": "96x64", "num_frames": 9, "num_inference_steps": 2, "seed": 0,
            "input_reference": data_url(image)}
    resp = httpx.post(f"{server.url}/v1/videos/sync", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert decode_mp4(resp.content).shape == (9, 64, 96, 3)
    missing = httpx.post(f"{server.url}/v1/videos/sync", json={k: v for k, v in body.items()
                                                               if k != "input_reference"}, timeout=60)
    assert missing.status_code == 400 and "image" in missing.json()["error"]["message"]
