"""Pins that our QwenImagePipeline reproduces diffusers' images on the same tiny weights and seed, that a
batch of requests equals the same requests run alone, and that a bad request fails alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen_image_test_utils import make_request, psnr

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

SIZE = dict(height=64, width=64, num_inference_steps=4)


@pytest.fixture(scope="module")
def pipes(dist_world, qwen_image_dir):
    from diffusers import QwenImagePipeline as Reference

    ref = Reference.from_pretrained(qwen_image_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    ours = QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(qwen_image_dir)), qwen_image_dir,
                                             torch.device("cpu"), torch.float32)
    return ref, ours


def _run(ours, *requests):
    with torch.inference_mode():
        outputs = ours.forward(DiffusionRequestBatch(list(requests)))
    return outputs


@pytest.mark.parametrize("negative", ["blurry, low quality", None], ids=["true-cfg", "no-cfg"])
def test_matches_diffusers(pipes, negative):
    ref, ours = pipes
    expected = ref("a red cat on a mat", negative_prompt=negative, true_cfg_scale=4.0, **SIZE,
                   generator=torch.Generator().manual_seed(7)).images
    out = _run(ours, make_request("a red cat on a mat", negative_prompt=negative, true_cfg_scale=4.0, seed=7,
                                  **SIZE))[0]
    assert out.error is None
    assert len(out.output) == 1 and out.output[0].size == (64, 64)
    assert psnr(out.output[0], expected[0]) >= 40
    assert set(out.stage_durations) >= {"text_encoder", "denoise", "vae_decode"}


def test_num_outputs_per_prompt_matches_diffusers(pipes):
    ref, ours = pipes
    expected = ref("two dogs", negative_prompt=" ", num_images_per_prompt=2, **SIZE, output_type="np",
                   generator=torch.Generator().manual_seed(3)).images
    out = _run(ours, make_request("two dogs", negative_prompt=" ", num_outputs_per_prompt=2, seed=3,
                                  output_type="np", **SIZE))[0]
    assert len(out.output) == 2
    np.testing.assert_allclose(np.stack(out.output), expected, atol=1e-4)
    assert not np.allclose(expected[0], expected[1])  # two different draws, not one image twice


def test_batch_equals_single_runs(pipes):
    _, ours = pipes
    specs = [("a tiny house", "dark", 1), ("an astronaut riding a horse on the moon, photo", "cartoon, drawing", 2),
             ("x", "a much longer negative prompt than the positive one", 3)]
    requests = [make_request(p, f"r{i}", negative_prompt=n, seed=s, output_type="np", **SIZE)
                for i, (p, n, s) in enumerate(specs)]
    batched = _run(ours, *requests)
    for request, out in zip(requests, batched, strict=True):
        alone = _run(ours, request)[0]
        np.testing.assert_allclose(out.output[0], alone.output[0], atol=1e-5)
    assert not np.allclose(batched[0].output[0], batched[1].output[0])


def test_rows_of_different_prompt_lengths_share_one_forward(pipes):
    """Positive and negative rows of different prompt lengths: one transformer forward per step, told each row's
    real text length (no mask), and the same images as each request alone."""
    _, ours = pipes
    specs = [("a tiny house", "dark"), ("an astronaut riding a horse on the moon, photo", "dark")]
    requests = [make_request(p, f"g{i}", negative_prompt=n, seed=i, output_type="np", **SIZE)
                for i, (p, n) in enumerate(specs)]
    calls = []
    forward = ours.transformer.forward
    ours.transformer.forward = lambda x, embeds, mask, *a: calls.append((x.shape[0], mask, a[-1])) or forward(
        x, embeds, mask, *a)
    try:
        batched = _run(ours, *requests)
    finally:
        del ours.transformer.forward
    assert len(calls) == SIZE["num_inference_steps"]
    rows, mask, lengths = calls[0]
    assert rows == 4 and mask is None and len(set(lengths)) == 3 and lengths[2] == lengths[3]
    for request, out in zip(requests, batched, strict=True):
        np.testing.assert_allclose(out.output[0], _run(ours, request)[0].output[0], atol=1e-5)


def test_bad_request_fails_alone(pipes):
    _, ours = pipes
    good = make_request("a boat", "good", seed=1, **SIZE)
    empty = make_request("   ", "empty", seed=1, **SIZE)
    outs = _run(ours, good, empty)
    assert outs[0].error is None and outs[0].output
    assert outs[1].error is not None and "prompt" in outs[1].error and outs[1].error_status_code == 400
    bad_size = _run(ours, make_request("a boat", height=72, width=64, num_inference_steps=1))[0]
    assert "height must be a multiple of 16" in bad_size.error and bad_size.error_status_code == 400


@pytest.mark.cuda
def test_cuda_bf16_matches_diffusers(dist_world, qwen_image_dir):
    """On the GPU in bf16 (the serving setup): same image as diffusers' bf16 pipeline, batched CFG included."""
    from diffusers import QwenImagePipeline as Reference

    device = torch.device("cuda")
    ref = Reference.from_pretrained(qwen_image_dir, dtype=torch.bfloat16).to(device)
    ref.set_progress_bar_config(disable=True)
    ours = QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(qwen_image_dir)), qwen_image_dir,
                                             device, torch.bfloat16)
    expected = ref("a red cat on a mat", negative_prompt="blurry", true_cfg_scale=4.0, **SIZE,
                   generator=torch.Generator().manual_seed(7)).images
    out = _run(ours, make_request("a red cat on a mat", negative_prompt="blurry", true_cfg_scale=4.0, seed=7,
                                  **SIZE))[0]
    assert out.error is None, out.error
    assert psnr(out.output[0], expected[0]) >= 30


@pytest.mark.cuda
def test_accelerated_pipeline_matches_eager_on_cuda(dist_world, qwen_image_dir):
    """enforce_eager=False on CUDA (compiled blocks, fused Triton q/k prologue, CUDA graphs), CFG rows of different
    prompt lengths in one forward, prompts of new lengths: same images as the eager pipeline."""
    device = torch.device("cuda", torch.cuda.current_device())
    pipes = [QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(qwen_image_dir), enforce_eager=eager),
                                               qwen_image_dir, device, torch.bfloat16) for eager in (True, False)]
    for prompt, negative in (("a red cat on a mat", "blurry"), ("a boat", "low quality, watermark, text, frame")):
        request = make_request(prompt, negative_prompt=negative, true_cfg_scale=4.0, seed=7, **SIZE)
        eager, fast = (_run(p, request)[0] for p in pipes)
        assert fast.error is None, fast.error
        assert psnr(fast.output[0], eager.output[0]) >= 40
    assert 1 <= len(pipes[1].transformer.compiled_forward.runner.graphs) <= 4
