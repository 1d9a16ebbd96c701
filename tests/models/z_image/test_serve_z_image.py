"""Live `vllm serve tiny/z-image-turbo --omni`, driven by the official `openai` client.

Pins: a request naming nothing but prompt, size and seed gets Z-Image-Turbo's intended image (diffusers'
pipeline at the model card's 9 steps and guidance 0, >= 40 dB); a size the model cannot make is a 400 naming
the field, before anything is queued."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.openai.live_server import LiveServer
from tests.models.image_checks import pixels, psnr

MODEL = "tiny/z-image-turbo"


@pytest.fixture(scope="module")
def client(stop_later):
    srv = LiveServer(MODEL)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    stop_later(srv)


def test_bare_request_gives_the_turbo_defaults_image(client, z_image_dir):
    from diffusers import ZImagePipeline

    res = client.images.generate(model=MODEL, prompt="a red cube on a table", size="64x48", extra_body={"seed": 3})
    got = pixels(res.data[0].b64_json)
    ref = ZImagePipeline.from_pretrained(z_image_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    want = ref(
        prompt="a red cube on a table",
        height=48,
        width=64,
        num_inference_steps=9,
        guidance_scale=0.0,
        generator=torch.Generator().manual_seed(3),
    ).images[0]
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape == (48, 64, 3) and want.std() > 1.0
    assert psnr(got, want) >= 40.0


def test_size_off_the_latent_grid_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model=MODEL, prompt="a red cube", size="40x40", extra_body={"num_inference_steps": 1})
    assert "width must be a multiple of 16" in str(err.value)
