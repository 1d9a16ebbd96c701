"""Pins that our QwenImageEditPipeline reproduces diffusers' QwenImageEditPipeline on the same tiny weights
and seed (input image through both the VL encoder and the VAE), and that batching does not change images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_image_test_utils import make_request, psnr

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.models.qwen_image.pipeline_edit import QwenImageEditPipeline

SIZE = dict(height=64, width=64, num_inference_steps=2)


def _image(seed: int, size=(64, 48)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


def _reference_processor(model_dir, monkeypatch):
    """diffusers' pipeline needs a Qwen2VLProcessor; without torchvision it can only be built without its
    video half (unused for images), so the class check is skipped for this construction only."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    monkeypatch.setattr(Qwen2VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
    return Qwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(model_dir / "processor"),
                            tokenizer=AutoTokenizer.from_pretrained(model_dir / "processor"), video_processor=None)


@pytest.fixture(scope="module")
def ours(dist_world, qwen_image_edit_dir):
    return QwenImageEditPipeline.from_pretrained(OmniDiffusionConfig(model=str(qwen_image_edit_dir)),
                                                 qwen_image_edit_dir, torch.device("cpu"), torch.float32)


def _run(pipe, *requests):
    with torch.inference_mode():
        return pipe.forward(DiffusionRequestBatch(list(requests)))


def test_matches_diffusers(ours, qwen_image_edit_dir, monkeypatch):
    from diffusers import QwenImageEditPipeline as Reference

    ref = Reference.from_pretrained(qwen_image_edit_dir, processor=_reference_processor(qwen_image_edit_dir,
                                                                                          monkeypatch),
                                    dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    image = _image(0)
    expected = ref(image=image, prompt="make the sky red", negative_prompt=" ", true_cfg_scale=4.0, **SIZE,
                   generator=torch.Generator().manual_seed(5)).images
    out = _run(ours, make_request("make the sky red", image=image, negative_prompt=" ", true_cfg_scale=4.0,
                                  seed=5, **SIZE))[0]
    assert out.error is None, out.error
    assert psnr(out.output[0], expected[0]) >= 40
    assert set(out.stage_durations) >= {"text_encoder", "vae_encode", "denoise", "vae_decode"}


def test_batch_equals_single_runs_and_missing_image_fails_alone(ours):
    params = dict(height=64, width=64, num_inference_steps=2, output_type="np")  # 1 step: NaN (shift_terminal)
    requests = [make_request("add a hat", "a", image=_image(1), negative_prompt="ugly", seed=1, **params),
                make_request("turn it into a watercolor painting", "b", image=_image(2), negative_prompt=" ",
                             seed=2, **params),
                make_request("no image here", "c", negative_prompt=" ", seed=3, **params)]
    batched = _run(ours, *requests)
    assert batched[2].error is not None and "input image" in batched[2].error
    assert batched[2].error_status_code == 400
    assert all(np.isfinite(out.output[0]).all() for out in batched[:2])  # allclose would pass two NaN images
    # The longer prompt and the other image in the batch must not change request b's image.
    np.testing.assert_allclose(batched[1].output[0], _run(ours, requests[1])[0].output[0], atol=1e-5)
    assert not np.allclose(batched[0].output[0], batched[1].output[0])
