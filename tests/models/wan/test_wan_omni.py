"""Wan through the whole runtime: `Omni("tiny/wan2.1-t2v").generate(...)` (engine + worker process) vs diffusers.

Why it matters: the acceptance bar of issue #7 is that our runtime, not just the pipeline object, returns
frames within PSNR >= 60 dB of diffusers' WanPipeline (issue #7's bar was 35 dB; the pipelines reach 88 dB
to bit-identical on CPU fp32); it also pins the video output format
({"video": uint8 (T, H, W, 3), "fps"}), per-stage durations, and that the two prompts shared one forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.inputs.data import OmniDiffusionSamplingParams

SIZE = dict(height=32, width=48, num_frames=9, num_inference_steps=4, max_sequence_length=64)


@pytest.fixture(scope="module")
def omni():
    from vllm_omni.entrypoints.omni import Omni

    engine = Omni("tiny/wan2.1-t2v", max_num_seqs=2, request_batch_max_wait_ms=500)
    yield engine
    engine.close()


def test_omni_generate_video_matches_diffusers(omni):
    from diffusers import WanPipeline as RefPipeline

    from vllm_omni.catalog.tiny import build_tiny

    assert omni.stage_types == ["diffusion"] and omni.output_modalities == {"video"}
    prompts = ["A cat walks on the grass, camera slowly pans left.", "Ocean waves crash against the rocks."]
    sp = OmniDiffusionSamplingParams(seed=21, guidance_scale=5.0, fps=8, **SIZE)
    outputs = omni.generate(prompts, sp, use_tqdm=False)
    assert len(outputs) == 2
    ref = RefPipeline.from_pretrained(build_tiny("wan2.1-t2v"), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.error is None and out.final_output_type == "video"
        video, fps = out.multimodal_output["video"], out.multimodal_output["fps"]
        assert fps == 8 and video.dtype == np.uint8 and video.shape == (9, 32, 48, 3)
        assert {"diffusion.text_encoder", "diffusion.denoise", "diffusion.vae_decode"} <= set(out.stage_durations)
        expected = ref(prompt=prompt, generator=torch.Generator("cpu").manual_seed(21), output_type="np",
                       guidance_scale=5.0, **SIZE).frames[0]
        mse = np.mean((video.astype(np.float64) - (expected * 255).round()) ** 2)
        assert mse == 0 or 10 * np.log10(255.0**2 / mse) >= 60.0


def test_omni_image_to_video_matches_diffusers():
    """The input image crosses the engine/worker boundary intact: I2V through Omni equals diffusers."""
    from diffusers import WanImageToVideoPipeline as RefPipeline
    from PIL import Image

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.entrypoints.omni import Omni

    image = Image.fromarray((np.random.default_rng(0).random((40, 64, 3)) * 255).astype(np.uint8))
    size = {**SIZE, "max_sequence_length": 512}  # diffusers' Wan I2V attention assumes 512 text tokens
    omni = Omni("tiny/wan2.1-i2v")
    try:
        (out,) = omni.generate([{"prompt": "A cat.", "multi_modal_data": {"image": image}}],
                               OmniDiffusionSamplingParams(seed=1, **size), use_tqdm=False)
    finally:
        omni.close()
    assert out.error is None and "diffusion.image_encoder" in out.stage_durations
    ref = RefPipeline.from_pretrained(build_tiny("wan2.1-i2v"), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    expected = ref(image=image, prompt="A cat.", generator=torch.Generator("cpu").manual_seed(1), output_type="np",
                   **size).frames[0]
    video = out.multimodal_output["video"]
    mse = np.mean((video.astype(np.float64) - (expected * 255).round()) ** 2)
    assert video.std() > 1.0 and (mse == 0 or 10 * np.log10(255.0**2 / mse) >= 60.0)


def test_omni_wan22_a14b_matches_diffusers():
    """Both experts (switch at boundary_ratio, guidance_scale_2) through the runtime equal diffusers."""
    from diffusers import WanPipeline as RefPipeline

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.entrypoints.omni import Omni

    size = {**SIZE, "num_inference_steps": 8}  # with flow_shift 12 the timesteps straddle 875: both experts run
    params = dict(guidance_scale=4.0, guidance_scale_2=3.0)
    omni = Omni("tiny/wan2.2-t2v-a14b")
    try:
        (out,) = omni.generate(["Two astronauts float."], OmniDiffusionSamplingParams(seed=5, **size, **params),
                               use_tqdm=False)
    finally:
        omni.close()
    assert out.error is None
    ref = RefPipeline.from_pretrained(build_tiny("wan2.2-t2v-a14b"), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    expected = ref(prompt="Two astronauts float.", generator=torch.Generator("cpu").manual_seed(5), output_type="np",
                   **size, **params).frames[0]
    video = out.multimodal_output["video"]
    mse = np.mean((video.astype(np.float64) - (expected * 255).round()) ** 2)
    assert video.std() > 1.0 and (mse == 0 or 10 * np.log10(255.0**2 / mse) >= 60.0)


def test_omni_wan_honours_diffusion_attention_backend(monkeypatch):
    """`--diffusion-attention-backend` reaches the worker's Wan layers (issue 12: Wan used to ignore it).

    The env fallback names a backend that does not exist and the worker processes inherit it: a layer that
    did not get the stage's TORCH_SDPA from its constructor would fail the model load.
    """
    from vllm_omni.entrypoints.omni import Omni

    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "NOPE")
    omni = Omni("tiny/wan2.1-t2v", diffusion_attention_backend="TORCH_SDPA")
    try:
        (out,) = omni.generate(["A cat."], OmniDiffusionSamplingParams(seed=3, **SIZE), use_tqdm=False)
    finally:
        omni.close()
    assert out.error is None and out.multimodal_output["video"].shape == (9, 32, 48, 3)
