"""Our Wan image-to-video pipeline vs diffusers' WanImageToVideoPipeline on the same tiny weights and seed.

Why it matters: I2V adds the CLIP image branch and the first-frame latent/mask conditioning; PSNR >= 60 dB
against diffusers pins both, with two requests (different images) batched into one forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

# diffusers' Wan attention assumes exactly 512 text tokens when image tokens are present.
SIZE = dict(height=32, width=48, num_frames=9, num_inference_steps=4, max_sequence_length=512)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def make_image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, 64 * 40 * 3).reshape(40, 64, 3)
    return Image.fromarray(((base + rng.integers(0, 60, base.shape)) % 256).astype(np.uint8))


@pytest.fixture(scope="module")
def pipelines(dist_world, wan21_i2v_dir):
    from diffusers import WanImageToVideoPipeline as RefPipeline

    from vllm_omni.models.wan.pipeline_i2v import WanImageToVideoPipeline

    ours = WanImageToVideoPipeline.from_pretrained(OmniDiffusionConfig(model=str(wan21_i2v_dir)), wan21_i2v_dir,
                                                   torch.device("cpu"), torch.float32)
    ref = RefPipeline.from_pretrained(wan21_i2v_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ours, ref


def test_wan21_i2v_batched_matches_diffusers(pipelines):
    ours, ref = pipelines
    items = [("A cat walks on the grass.", 1, make_image(0)), ("A red car drives along a road.", 2, make_image(1))]
    requests = [
        OmniDiffusionRequest({"prompt": p, "multi_modal_data": {"image": img}},
                             OmniDiffusionSamplingParams(seed=s, guidance_scale=5.0, **SIZE), f"r{i}")
        for i, (p, s, img) in enumerate(items)
    ]
    outputs = ours.forward(DiffusionRequestBatch(requests))
    for (prompt, seed, image), out in zip(items, outputs, strict=True):
        assert out.error is None, out.error
        assert {"image_encoder", "vae_encode", "denoise", "vae_decode"} <= set(out.stage_durations)
        video = out.output["video"]
        assert video.shape == (9, 32, 48, 3) and video.std() > 1.0
        expected = ref(image=image, prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed),
                       output_type="np", guidance_scale=5.0, **SIZE).frames[0]
        assert psnr(video, (expected * 255).round().astype(np.uint8)) >= 60.0
    # Negative control: another image, prompt and seed give other frames (measured 17.8 dB, the bar is 60).
    assert psnr(outputs[0].output["video"], outputs[1].output["video"]) < 30.0


def test_i2v_without_image_fails_alone(pipelines):
    ours, _ = pipelines
    sp = OmniDiffusionSamplingParams(seed=0, **{**SIZE, "num_inference_steps": 1})
    missing = OmniDiffusionRequest("A cat.", sp, "missing")
    good = OmniDiffusionRequest({"prompt": "A cat.", "multi_modal_data": {"image": make_image(2)}}, sp, "good")
    bad, ok = ours.forward(DiffusionRequestBatch([missing, good]))
    assert bad.error_status_code == 400 and "image" in bad.error
    assert ok.error is None and ok.output["video"].shape == (9, 32, 48, 3)


def test_wan22_i2v_a14b_two_experts_without_clip_match_diffusers(dist_world):
    from diffusers import WanImageToVideoPipeline as RefPipeline

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.models.wan.pipeline_i2v import WanImageToVideoPipeline

    model_dir = build_tiny("wan2.2-i2v-a14b")
    ours = WanImageToVideoPipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir)), model_dir,
                                                   torch.device("cpu"), torch.float32)
    assert ours.image_encoder is None and ours.transformer_2 is not None and ours.boundary_ratio == 0.9
    ref = RefPipeline.from_pretrained(model_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    size = {**SIZE, "num_inference_steps": 6}  # with flow_shift 5 the timesteps straddle 900: both experts run
    params = dict(guidance_scale=3.5, guidance_scale_2=2.0)
    image = make_image(3)
    request = OmniDiffusionRequest({"prompt": "A dog runs.", "multi_modal_data": {"image": image}},
                                   OmniDiffusionSamplingParams(seed=4, **size, **params), "a14b")
    (out,) = ours.forward(DiffusionRequestBatch([request]))
    assert out.error is None, out.error
    expected = ref(image=image, prompt="A dog runs.", generator=torch.Generator("cpu").manual_seed(4),
                   output_type="np", **size, **params).frames[0]
    assert out.output["video"].std() > 1.0
    assert psnr(out.output["video"], (expected * 255).round().astype(np.uint8)) >= 60.0
