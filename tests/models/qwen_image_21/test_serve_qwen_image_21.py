"""Live `vllm serve tiny/qwen-image-2.1 --omni --step-execution --max-num-seqs 4`, driven by the official
`openai` client.

Pins: a request naming prompt, size, steps and seed gets diffusers' `QwenImage21Pipeline` image (>= 40 dB);
four requests with different prompts sent at once (step mode co-batches them, each with its own prefix K/V)
each get the image it gets alone (>= 60 dB); `images.edit` with a condition image gets diffusers' edit (>= 40 dB);
a size the model cannot make is a 400 naming the field."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.openai.live_server import LiveServer
from tests.models.image_checks import pixels, psnr

MODEL = "tiny/qwen-image-2.1"
PROMPTS = ["a red cube on a table", "a blue sphere", "two green cones in the snow at dusk", "a cat"]


@pytest.fixture(scope="module")
def client(stop_later):
    srv = LiveServer(MODEL, "--step-execution", "--max-num-seqs", "4")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    stop_later(srv)


@pytest.fixture(scope="module")
def reference(qwen_image_21_dir):
    from diffusers import QwenImage21Pipeline
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(qwen_image_21_dir / "processor")
    with pytest.MonkeyPatch.context() as mp:  # the processor's video half needs torchvision
        mp.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
        processor = Qwen3VLProcessor(
            AutoImageProcessor.from_pretrained(qwen_image_21_dir / "processor"),
            tokenizer,
            None,
            chat_template=tokenizer.chat_template,
        )
    ref = QwenImage21Pipeline.from_pretrained(qwen_image_21_dir, processor=processor, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ref


def generate(client, prompt: str, seed: int) -> np.ndarray:
    res = client.images.generate(
        model=MODEL, prompt=prompt, size="96x64", extra_body={"seed": seed, "num_inference_steps": 4}
    )
    return pixels(res.data[0].b64_json)


def test_request_gives_diffusers_image(client, reference):
    got = generate(client, PROMPTS[0], 3)
    want = reference(
        prompt=PROMPTS[0], height=64, width=96, num_inference_steps=4, generator=torch.Generator().manual_seed(3)
    ).images[0]
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape == (64, 96, 4) and want.std() > 1.0  # the VAE decodes RGBA
    assert psnr(got, want) >= 40.0


def test_concurrent_prompts_each_get_their_solo_image(client):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda i: generate(client, PROMPTS[i], 10 + i), range(len(PROMPTS))))
    for i, image in enumerate(together):
        assert psnr(image, generate(client, PROMPTS[i], 10 + i)) >= 60.0
    assert psnr(together[1], together[2]) < 30.0


def test_edit_gives_diffusers_edit(client, reference):
    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(buf, format="PNG")
    res = client.images.edit(
        model=MODEL,
        image=("in.png", buf.getvalue(), "image/png"),
        prompt="make it blue",
        size="96x64",
        extra_body={"seed": 5, "num_inference_steps": 2},
    )
    got = pixels(res.data[0].b64_json)
    want = reference(
        prompt="make it blue",
        image=Image.open(io.BytesIO(buf.getvalue())),
        height=64,
        width=96,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(5),
    ).images[0]
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape == (64, 96, 4)
    assert psnr(got, want) >= 40.0


def test_size_off_the_latent_grid_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model=MODEL, prompt="a red cube", size="48x48", extra_body={"num_inference_steps": 1})
    assert "width must be a multiple of 32" in str(err.value)
