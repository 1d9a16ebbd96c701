"""Live `vllm serve tiny/flux2-klein --omni`, driven by the official `openai` client.

Pins: a request naming nothing but prompt, size and seed gets the step-distilled checkpoint's intended image
(diffusers' pipeline at the model card's 4 steps without guidance, >= 40 dB); `images.edit` with an uploaded
reference image equals diffusers' edit of that image (>= 40 dB)."""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.entrypoints.openai.live_server import LiveServer
from tests.models.image_checks import pixels, psnr

MODEL = "tiny/flux2-klein"


@pytest.fixture(scope="module")
def client(stop_later):
    srv = LiveServer(MODEL)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    stop_later(srv)


@pytest.fixture(scope="module")
def reference(klein_dir):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(klein_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_bare_request_gives_the_distilled_defaults_image(client, reference):
    res = client.images.generate(model=MODEL, prompt="a red cube on a table", size="64x48", extra_body={"seed": 3})
    want = reference(
        prompt="a red cube on a table",
        height=48,
        width=64,
        num_inference_steps=4,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(3),
    ).images[0]
    got, want = pixels(res.data[0].b64_json), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape == (48, 64, 3) and want.std() > 1.0
    assert psnr(got, want) >= 40.0


def test_images_edit_matches_diffusers(client, reference):
    source = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8))
    buf = io.BytesIO()
    source.save(buf, format="PNG")
    res = client.images.edit(
        model=MODEL,
        image=("in.png", buf.getvalue(), "image/png"),
        prompt="make it blue",
        size="80x64",
        extra_body={"seed": 1},
    )
    want = reference(
        image=[source],
        prompt="make it blue",
        height=64,
        width=80,
        num_inference_steps=4,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(1),
    ).images[0]
    got, want = pixels(res.data[0].b64_json), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape == (64, 80, 3)
    assert psnr(got, want) >= 40.0
