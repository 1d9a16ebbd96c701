"""Wan2.2 TI2V 5B (per-token timesteps, 48-channel VAE with 16x compression) vs diffusers on tiny weights.

Why it matters: TI2V takes a different path through the DiT (a timestep per token, so the given first frame's
tokens stay clean) and through the VAE (2x2 patchify); text-to-video and image-to-video must both match
diffusers' WanPipeline / WanImageToVideoPipeline at PSNR >= 60 dB (measured 90-96 dB on CPU fp32).
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

SIZE = dict(height=64, width=96, num_frames=9, num_inference_steps=3, max_sequence_length=64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def ti2v_dir():
    from vllm_omni.catalog.tiny import build_tiny

    return build_tiny("wan2.2-ti2v-5b")


def test_per_token_timesteps_match_diffusers(dist_world, ti2v_dir):
    from diffusers import WanTransformer3DModel as RefModel

    from vllm_omni.diffusion.model_loader.diffusers_loader import iter_component_weights
    from vllm_omni.diffusion.model_loader.weight_utils import process_weights_after_loading
    from vllm_omni.models.wan.transformer import WanTransformer3DModel, WanTransformerConfig

    ours = WanTransformer3DModel(WanTransformerConfig.from_json(ti2v_dir / "transformer" / "config.json"))
    ours.load_weights(iter_component_weights(ti2v_dir, "transformer"))
    process_weights_after_loading(ours)
    ref = RefModel.from_pretrained(ti2v_dir / "transformer", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, 3, 4, 6, generator=gen)
    t = torch.full((2, 3 * 2 * 3), 700.0)
    t[:, :6] = 0.0  # first latent frame clean
    text = torch.randn(2, 16, 32, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, t, text), ref(x, t, text, return_dict=False)[0], rtol=1e-4, atol=1e-4)


def test_ti2v_text_to_video_matches_diffusers(dist_world, ti2v_dir):
    from diffusers import WanPipeline as RefPipeline

    from vllm_omni.models.wan.pipeline import WanPipeline

    ours = WanPipeline.from_pretrained(OmniDiffusionConfig(model=str(ti2v_dir)), ti2v_dir, torch.device("cpu"),
                                       torch.float32)
    assert ours.expand_timesteps
    ref = RefPipeline.from_pretrained(ti2v_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    request = OmniDiffusionRequest("A cat walks.", OmniDiffusionSamplingParams(seed=2, guidance_scale=5.0, **SIZE),
                                   "t2v")
    (out,) = ours.forward(DiffusionRequestBatch([request]))
    assert out.error is None, out.error
    expected = ref(prompt="A cat walks.", generator=torch.Generator("cpu").manual_seed(2), output_type="np",
                   guidance_scale=5.0, **SIZE).frames[0]
    video = out.output["video"]
    assert video.shape == (9, 64, 96, 3) and video.std() > 1.0
    assert psnr(video, (expected * 255).round()) >= 60.0


def test_ti2v_image_to_video_matches_diffusers(dist_world, ti2v_dir):
    from diffusers import WanImageToVideoPipeline as RefPipeline

    from vllm_omni.models.wan.pipeline_i2v import WanImageToVideoPipeline

    ours = WanImageToVideoPipeline.from_pretrained(OmniDiffusionConfig(model=str(ti2v_dir)), ti2v_dir,
                                                   torch.device("cpu"), torch.float32)
    ref = RefPipeline.from_pretrained(ti2v_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8))
    sp = OmniDiffusionSamplingParams(seed=5, guidance_scale=5.0, **SIZE)
    request = OmniDiffusionRequest({"prompt": "A dog.", "multi_modal_data": {"image": image}}, sp, "i2v")
    (out,) = ours.forward(DiffusionRequestBatch([request]))
    assert out.error is None, out.error
    expected = ref(image=image, prompt="A dog.", generator=torch.Generator("cpu").manual_seed(5), output_type="np",
                   guidance_scale=5.0, **SIZE).frames[0]
    assert out.output["video"].std() > 1.0
    assert psnr(out.output["video"], (expected * 255).round()) >= 60.0
