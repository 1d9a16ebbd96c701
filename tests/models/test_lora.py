"""Per-request LoRA on the native pipelines (fp32, CPU, tiny weights).

Pins: a request with an adapter equals diffusers' `load_lora_weights` + `set_adapters` on the same base weights
and file (Qwen-Image, FLUX, Wan); requests with no adapter, adapter A, adapter B and A at another scale share
ONE transformer forward per step, each equal to its solo run (request mode and step mode); bad adapters fail
alone naming `lora`.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.model_loader.tiny_lora import write_tiny_lora
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

pytestmark = pytest.mark.usefixtures("dist_world")

FAMILIES = {
    # tiny checkpoint, our pipeline, diffusers' pipeline, request sizes, extra call arguments
    "qwen-image": (
        "vllm_omni.models.qwen_image.pipeline:QwenImagePipeline",
        "QwenImagePipeline",
        dict(height=64, width=64, num_inference_steps=3),
        dict(true_cfg_scale=4.0),
    ),
    "flux": (
        "vllm_omni.models.flux.pipeline:FluxPipeline",
        "FluxPipeline",
        dict(height=64, width=64, num_inference_steps=3),
        dict(guidance_scale=3.5),
    ),
    "wan2.1-t2v": (
        "vllm_omni.models.wan.pipeline:WanPipeline",
        "WanPipeline",
        dict(height=32, width=48, num_frames=5, num_inference_steps=3),
        dict(guidance_scale=5.0),
    ),
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _ours(family: str, **config):
    import importlib

    module, name = FAMILIES[family][0].split(":")
    model_dir = build_tiny(family)
    od_config = OmniDiffusionConfig(model=str(model_dir), dtype="float32", enable_lora=True, **config)
    return getattr(importlib.import_module(module), name).from_pretrained(
        od_config, model_dir, torch.device("cpu"), torch.float32
    )


def _request(family: str, seed: int, lora=None, request_id: str | None = None, **params) -> OmniDiffusionRequest:
    _, _, size, extra = FAMILIES[family]
    sp = OmniDiffusionSamplingParams(**size, **extra, seed=seed, output_type="np", lora=lora, **params)
    return OmniDiffusionRequest(f"a photo of a cat number {seed}", sp, request_id or f"r{seed}")


def _frames(output) -> np.ndarray:
    assert output.error is None, output.error
    if isinstance(output.output, dict):  # video: uint8 frames
        return output.output["video"].astype(np.float64) / 255
    return np.asarray(output.output[0], np.float64)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters per family: A (rank 4, no config: scale 1) and B (rank 8, lora_alpha 4 in its config)."""
    root = tmp_path_factory.mktemp("loras")
    return {
        family: (
            write_tiny_lora(build_tiny(family), root / family / "a.safetensors", rank=4, seed=1),
            write_tiny_lora(build_tiny(family), root / family / "b.safetensors", rank=8, alpha=4, seed=2),
        )
        for family in FAMILIES
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_matches_diffusers(family, adapters):
    import diffusers

    _, reference_name, size, extra = FAMILIES[family]
    path_a, path_b = adapters[family]
    reference = getattr(diffusers, reference_name).from_pretrained(build_tiny(family), dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(path_a), adapter_name="lora_one")
    reference.load_lora_weights(str(path_b), adapter_name="lora_two")
    ours = _ours(family, max_loras=3)
    negative = {} if family == "flux" else {"negative_prompt": "blurry"}
    mixes = [[("lora_one", path_a, 0.8)], [("lora_one", path_a, 1.0), ("lora_two", path_b, 0.6)]]
    if family == "flux":  # FLUX files may carry `.alpha` tensors (diffusers returns them apart)
        path_c = write_tiny_lora(
            build_tiny(family), path_a.with_name("c.safetensors"), rank=4, alpha=2, seed=3, alpha_tensors=True
        )
        reference.load_lora_weights(str(path_c), adapter_name="lora_three")
        mixes.append([("lora_three", path_c, 0.9)])
    for mix in mixes:
        reference.set_adapters([name for name, _, _ in mix], [scale for _, _, scale in mix])
        want = reference(
            "a photo of a cat number 5",
            **size,
            **extra,
            **negative,
            output_type="np",
            generator=torch.Generator().manual_seed(5),
        )
        want = want.frames[0] if family.startswith("wan") else want.images[0]
        lora = [{"path": str(path), "scale": scale} for _, path, scale in mix]
        request = _request(family, 5, lora=lora, **negative)
        with torch.inference_mode():
            got = _frames(ours.forward(DiffusionRequestBatch([request]))[0])
            base = _frames(ours.forward(DiffusionRequestBatch([_request(family, 5, **negative)]))[0])
        assert psnr(got, want) >= 40, (mix, psnr(got, want), psnr(base, want))
        assert psnr(base, want) < psnr(got, want) - 15  # the adapter changed the image: the comparison sees it


def _mixed_batch(family: str, adapters) -> list[OmniDiffusionRequest]:
    """No adapter, A, B, A at another scale; with CFG (each request's negative rows run its adapters too)."""
    path_a, path_b = (str(p) for p in adapters[family])
    loras = [None, {"path": path_a}, {"path": path_b, "scale": 0.7}, {"path": path_a, "scale": -0.5}]
    cfg = {"true_cfg_scale": 3.0} if family == "flux" else {}
    return [
        _request(family, 10 + i, lora=lora, request_id=f"m{i}", negative_prompt=f"blurry {i}", **cfg)
        for i, lora in enumerate(loras)
    ]


def _count_forwards(pipe) -> list[int]:
    """One entry per transformer forward: its batch rows."""
    rows: list[int] = []
    pipe.transformer.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    return rows


@pytest.mark.parametrize("family", ["qwen-image", "flux"])
@pytest.mark.parametrize("mode", ["request", "step"])
def test_mixed_adapters_share_one_forward_and_equal_solo(family, mode, adapters):
    from tests.diffusion.step_harness import Harness

    pipe = _ours(family, max_loras=2, max_num_seqs=4)
    requests = _mixed_batch(family, adapters)
    with torch.inference_mode():
        solo = [_frames(pipe.forward(DiffusionRequestBatch([r]))[0]) for r in requests]
    forwards = _count_forwards(pipe)
    if mode == "request":
        with torch.inference_mode():
            outputs = pipe.forward(DiffusionRequestBatch(requests))
    else:
        harness = Harness(pipe, max_num_seqs=4)
        for request in requests:
            harness.add(request)
        with torch.inference_mode():
            harness.drain()
        outputs = [harness.outputs[r.request_id] for r in requests]
    steps = requests[0].sampling_params.num_inference_steps
    assert len(forwards) == steps, forwards  # all four requests in every step's one forward
    values = [psnr(_frames(out), expected) for out, expected in zip(outputs, solo, strict=True)]
    assert min(values) >= 60, values
    assert psnr(solo[0], solo[1]) < 40 and psnr(solo[1], solo[3]) < 40  # the adapters and scales matter


def test_bad_adapters_fail_alone_naming_lora(adapters, tmp_path):
    from safetensors.torch import save_file

    pipe = _ours("qwen-image", max_lora_rank=4, max_num_seqs=4)
    path_a, path_b = adapters["qwen-image"]
    foreign = tmp_path / "foreign.safetensors"  # another model's module names
    save_file(
        {
            "transformer.down_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8),
            "transformer.down_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4),
        },
        str(foreign),
    )
    modulation = write_tiny_lora(
        build_tiny("qwen-image"), tmp_path / "mod.safetensors", targets=re.compile(r"img_mod\.1$")
    )
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    bad = {
        "unknown": {"name": "never-registered"},
        "rank": {"path": str(path_b)},
        "keys": {"path": str(foreign)},
        "modulation": {"path": str(modulation)},
        "junk": {"path": str(tmp_path / "junk.safetensors")},
    }
    requests = [_request("qwen-image", 1, lora={"path": str(path_a)}, request_id="good")] + [
        _request("qwen-image", 1, lora=lora, request_id=why) for why, lora in bad.items()
    ]
    with torch.inference_mode():
        outputs = pipe.forward(DiffusionRequestBatch(requests))
    assert outputs[0].error is None
    for (why, _), out in zip(bad.items(), outputs[1:], strict=True):
        assert out.error is not None and out.error_param == "lora", (why, out.error)
    assert "rank 8" in outputs[2].error and "--max-lora-rank 4" in outputs[2].error
    assert "down_blocks.0.attn.to_q" in outputs[3].error
    assert "adaLN" in outputs[4].error


def test_lora_needs_enable_lora(dist_world):
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    model_dir = build_tiny("qwen-image")
    pipe = QwenImagePipeline.from_pretrained(
        OmniDiffusionConfig(model=str(model_dir)), model_dir, torch.device("cpu"), torch.float32
    )
    (out,) = pipe.forward(DiffusionRequestBatch([_request("qwen-image", 1, lora={"path": "/x.safetensors"})]))
    assert out.error_param == "lora" and "--enable-lora" in out.error


@pytest.mark.slow
def test_tp2_lora_matches_diffusers(adapters):
    """FLUX at tensor-parallel size 2 (two gloo workers): A and B sharded as their linears are (q/k/v head shards,
    the single blocks' merged q/k/v/MLP projection, the row-parallel proj_out with its re-ordered columns and the
    all-reduced rank-sized product), two requests with different adapters in one batch."""
    from diffusers import FluxPipeline

    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    path_a, path_b = adapters["flux"]
    model_dir = build_tiny("flux")
    engine = DiffusionEngine(
        OmniDiffusionConfig.from_kwargs(
            model=str(model_dir),
            tensor_parallel_size=2,
            enable_lora=True,
            max_loras=2,
            max_num_seqs=2,
            request_batch_max_wait_ms=2000,
        )
    )
    try:
        futures = [
            engine.submit(_request("flux", 7, lora={"path": str(path), "scale": scale}, request_id=str(i)))
            for i, (path, scale) in enumerate([(path_a, 0.8), (path_b, 1.0)])
        ]
        got = [_frames(f.result(300)) for f in futures]
    finally:
        engine.close()
    reference = FluxPipeline.from_pretrained(model_dir, dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(path_a), adapter_name="lora_one")
    reference.load_lora_weights(str(path_b), adapter_name="lora_two")
    _, _, size, extra = FAMILIES["flux"]
    for out, (name, scale) in zip(got, [("lora_one", 0.8), ("lora_two", 1.0)], strict=True):
        reference.set_adapters([name], [scale])
        want = reference(
            "a photo of a cat number 7", **size, **extra, output_type="np", generator=torch.Generator().manual_seed(7)
        ).images[0]
        assert psnr(out, want) >= 40, (name, psnr(out, want))


@pytest.mark.parametrize("mode", ["request", "step"])
def test_more_adapters_than_max_loras_take_turns(mode, adapters):
    """--max-loras 1 with A, B, A: request mode cuts the batch into runs that fit, step mode steps the states
    apart when their shared forward would need both; every request still equals its solo run, and a request
    composing more adapters than stay resident is refused."""
    from tests.diffusion.step_harness import Harness

    pipe = _ours("qwen-image", max_loras=1, max_num_seqs=4)
    path_a, path_b = (str(p) for p in adapters["qwen-image"])
    requests = [
        _request("qwen-image", 20 + i, lora={"path": p}, request_id=f"t{i}")
        for i, p in enumerate([path_a, path_b, path_a])
    ]
    with torch.inference_mode():
        solo = [_frames(pipe.forward(DiffusionRequestBatch([r]))[0]) for r in requests]
        if mode == "request":
            outputs = pipe.forward(DiffusionRequestBatch(requests))
        else:
            harness = Harness(pipe, max_num_seqs=4)
            for request in requests:
                harness.add(request)
            harness.drain()
            outputs = [harness.outputs[r.request_id] for r in requests]
    assert min(psnr(_frames(out), want) for out, want in zip(outputs, solo, strict=True)) >= 60
    both = _request("qwen-image", 1, lora=[{"path": path_a}, {"path": path_b}])
    (out,) = pipe.forward(DiffusionRequestBatch([both]))
    assert out.error_param == "lora" and "--max-loras" in out.error
