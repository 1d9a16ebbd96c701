"""Live `vllm serve tiny/qwen-image --omni --enable-lora --lora-modules ...` driven by the official `openai` client:
the `lora` extension field on the images and chat routes (registered name or path, with a scale), vLLM's
runtime adapter routes (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), /v1/models listing the adapters, and bad adapters
answered 400 naming the field while the server goes on serving."""

from __future__ import annotations

import base64
import io
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from tests.entrypoints.openai.live_server import LiveServer
from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.model_loader.tiny_lora import write_tiny_lora

MODEL = "tiny/qwen-image"
FAST = {"num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root, model_dir = tmp_path_factory.mktemp("live_loras"), build_tiny("qwen-image")
    foreign = root / "foreign.safetensors"
    save_file(
        {
            "transformer.down_blocks.0.proj.lora_A.weight": torch.zeros(4, 8),
            "transformer.down_blocks.0.proj.lora_B.weight": torch.zeros(8, 4),
        },
        str(foreign),
    )
    return {
        "a": write_tiny_lora(model_dir, root / "a.safetensors", rank=4, seed=1),
        "b": write_tiny_lora(model_dir, root / "b.safetensors", rank=8, alpha=4, seed=2),
        "big": write_tiny_lora(model_dir, root / "big.safetensors", rank=16, seed=3),
        "foreign": foreign,
    }


@pytest.fixture(scope="module")
def server(loras, stop_later):
    previous = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        srv = LiveServer(
            MODEL,
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--max-num-seqs",
            "4",
            "--request-batch-max-wait-ms",
            "200",
            "--lora-modules",
            f"a={loras['a']}",
        )
    finally:
        if previous is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = previous
    yield srv
    stop_later(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def psnr(png_a: bytes, png_b: bytes) -> float:
    a, b = (np.asarray(Image.open(io.BytesIO(png)), np.float64) for png in (png_a, png_b))
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def image(client, lora=None, prompt="a red cube") -> bytes:
    extra = {**FAST, **({"lora": lora} if lora is not None else {})}
    res = client.images.generate(model=MODEL, prompt=prompt, size="32x32", extra_body=extra)
    return base64.b64decode(res.data[0].b64_json)


def test_registered_name_and_path_give_the_same_image(client, loras):
    base, named = image(client), image(client, {"name": "a", "scale": 0.8})
    assert named != base
    assert image(client, {"path": str(loras["a"]), "scale": 0.8}) == named
    assert image(client, {"name": "a", "scale": 0.3}) not in (named, base)


def test_requests_with_different_adapters_run_together(client, loras):
    """Four requests at once (none, a, b by path, a at another scale): each equals its own solo answer."""
    mixes = [None, {"name": "a"}, {"path": str(loras["b"]), "scale": 0.7}, {"name": "a", "scale": -0.5}]
    solo = [image(client, lora) for lora in mixes]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda lora: image(client, lora), mixes))
    assert min(psnr(a, b) for a, b in zip(together, solo, strict=True)) >= 50
    assert len(set(solo)) == 4


def test_chat_route_takes_lora(client):
    def chat_image(**extra) -> str:
        res = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a red cube"}],
            extra_body={**FAST, "size": "32x32", **extra},
        )
        part = res.choices[0].message.content[0]
        assert part["type"] == "image_url"
        return part["image_url"]["url"]

    assert chat_image(lora={"name": "a"}) != chat_image()


def test_runtime_load_list_and_unload(server, client, loras):
    url = server.url
    assert (
        httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(loras["b"])}, timeout=60
        ).status_code
        == 200
    )
    assert {m.id for m in client.models.list().data} >= {MODEL, "a", "b"}
    assert image(client, {"name": "b"}) == image(client, {"path": str(loras["b"])})
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(loras["b"])}, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60).status_code == 200
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60).status_code == 404
    with pytest.raises(openai.BadRequestError) as err:
        image(client, {"name": "b"})
    assert err.value.body["param"] == "lora"


@pytest.mark.parametrize("why", ["unknown", "rank", "keys", "malformed"])
def test_bad_adapters_are_400_naming_lora_and_the_server_serves_on(server, client, loras, why):
    lora = {
        "unknown": {"name": "nope"},
        "rank": {"path": str(loras["big"])},
        "keys": {"path": str(loras["foreign"])},
        "malformed": {"name": "a", "scale": "high"},
    }[why]
    with pytest.raises(openai.BadRequestError) as err:
        image(client, lora)
    assert err.value.body["param"] == "lora", err.value.body
    if why in ("rank", "keys"):  # the load route refuses the same files, naming the path
        res = httpx.post(
            f"{server.url}/v1/load_lora_adapter", json={"lora_name": why, "lora_path": lora["path"]}, timeout=60
        )
        assert res.status_code == 400 and res.json()["error"]["param"] == "lora_path", res.text
    assert image(client, {"name": "a"})  # the server and the registered adapter are unaffected


def test_multipart_forms_carry_lora_as_json():
    """/v1/images/edits and /v1/videos forms: `lora` (like `cache_config`) is a JSON value in its form field."""
    from vllm_omni.entrypoints.openai.protocol.common import coerce_form
    from vllm_omni.entrypoints.openai.protocol.images import ImageGenerationRequest
    from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest
    from vllm_omni.errors import OmniClientError

    for model in (ImageGenerationRequest, VideoGenerationRequest):
        form = coerce_form({"prompt": "x", "lora": '[{"name": "a", "scale": 0.5}]'}, model)
        assert model.model_validate(form).lora == [{"name": "a", "scale": 0.5}]
        with pytest.raises(OmniClientError) as err:
            coerce_form({"prompt": "x", "lora": "{name: a}"}, model)
        assert err.value.param == "lora"
