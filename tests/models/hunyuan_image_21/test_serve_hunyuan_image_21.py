"""Live `vllm serve tiny/hunyuan-image-2.1 --omni --step-execution --max-num-seqs 4`, driven by the official
`openai` client.

Pins: a request naming prompt, size, steps and seed gets diffusers' `HunyuanImagePipeline` image with its CFG /
APG guider (>= 40 dB); three requests sent at once (different prompts, one quoting text: the OCR guider and ByT5
tokens; step mode co-batches them, each with its own momentum buffer) each get the image it gets alone (>= 60 dB);
a size the model cannot make is a 400 naming the field, before anything is queued."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.openai.live_server import LiveServer
from tests.models.image_checks import pixels, psnr

MODEL = "tiny/hunyuan-image-2.1"
PROMPTS = ["a red cube on a table", 'a sign that says "HELLO"', "two green cones in the snow at dusk"]


@pytest.fixture(scope="module")
def client(stop_later):
    srv = LiveServer(MODEL, "--step-execution", "--max-num-seqs", "4")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    stop_later(srv)


def generate(client, prompt: str, seed: int) -> np.ndarray:
    res = client.images.generate(model=MODEL, prompt=prompt, size="48x32",
                                 extra_body={"seed": seed, "num_inference_steps": 3})
    return pixels(res.data[0].b64_json)


def test_request_gives_diffusers_image(client, hunyuan_image_21_dir):
    from diffusers import HunyuanImagePipeline

    got = generate(client, PROMPTS[0], 3)
    ref = HunyuanImagePipeline.from_pretrained(hunyuan_image_21_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    ref.tokenizer_max_length, ref.tokenizer_2_max_length = 64, 32  # masked padding: same image, less CPU
    want = ref(prompt=PROMPTS[0], height=32, width=48, num_inference_steps=3,
               generator=torch.Generator().manual_seed(3)).images[0]
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape == (32, 48, 3) and want.std() > 1.0
    assert psnr(got, want) >= 40.0


def test_concurrent_prompts_each_get_their_solo_image(client):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda i: generate(client, PROMPTS[i], 10 + i), range(len(PROMPTS))))
    for i, image in enumerate(together):
        assert psnr(image, generate(client, PROMPTS[i], 10 + i)) >= 60.0
    assert psnr(together[0], together[2]) < 30.0


def test_size_off_the_latent_grid_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model=MODEL, prompt="a red cube", size="44x44", extra_body={"num_inference_steps": 1})
    assert "width must be a multiple of 8" in str(err.value)
