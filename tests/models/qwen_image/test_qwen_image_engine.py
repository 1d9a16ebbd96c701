"""End to end through DiffusionEngine (real worker process) with `tiny/qwen-image`: two compatible requests
run in one forward and each image still matches diffusers' for its seed."""

from __future__ import annotations

import pytest
import torch
from qwen_image_test_utils import make_request, psnr

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

TIMEOUT = 120
SIZE = dict(height=64, width=64, num_inference_steps=4, true_cfg_scale=4.0)


@pytest.fixture(scope="module")
def engine():
    engine = DiffusionEngine(OmniDiffusionConfig(model="tiny/qwen-image", dtype="float32", max_num_seqs=2,
                                                 request_batch_max_wait_ms=500, init_timeout=300))
    yield engine
    engine.close()


def test_batched_requests_match_diffusers(engine, qwen_image_dir):
    from diffusers import QwenImagePipeline as Reference

    specs = [("a lighthouse at dusk", "blurry", 11), ("a bowl of ramen", "low quality, jpeg artifacts", 12)]
    before = engine.stats()
    futures = [engine.submit(make_request(p, f"e{i}", negative_prompt=n, seed=s, **SIZE))
               for i, (p, n, s) in enumerate(specs)]
    outs = [f.result(TIMEOUT) for f in futures]
    after = engine.stats()
    assert after["num_forwards"] - before["num_forwards"] == 1
    assert after["batch_sizes"].get(2, 0) - before["batch_sizes"].get(2, 0) == 1

    ref = Reference.from_pretrained(qwen_image_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    for (prompt, negative, seed), out in zip(specs, outs, strict=True):
        assert out.error is None, out.error
        expected = ref(prompt, negative_prompt=negative, **SIZE, generator=torch.Generator().manual_seed(seed))
        assert psnr(out.output[0], expected.images[0]) >= 40
        assert out.stage_durations["denoise"] > 0


@pytest.mark.slow
def test_tensor_parallel_2_matches_diffusers(qwen_image_dir):
    """Two worker processes sharding the MMDiT's heads and MLPs (gloo on CPU): same image as diffusers; a
    request without a seed still works (ranks agree on its random seed)."""
    from diffusers import QwenImagePipeline as Reference

    config = OmniDiffusionConfig.from_kwargs(model="tiny/qwen-image", dtype="float32", tensor_parallel_size=2,
                                             init_timeout=300)
    engine = DiffusionEngine(config)
    try:
        out = engine.submit(make_request("a red cat", "tp", negative_prompt="blurry", seed=7, **SIZE)).result(TIMEOUT)
        unseeded = engine.submit(make_request("a red cat", "tp-noseed", height=64, width=64,
                                              num_inference_steps=2)).result(TIMEOUT)
    finally:
        engine.close()
    assert out.error is None and unseeded.error is None, (out.error, unseeded.error)
    ref = Reference.from_pretrained(qwen_image_dir, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    expected = ref("a red cat", negative_prompt="blurry", **SIZE, generator=torch.Generator().manual_seed(7))
    assert psnr(out.output[0], expected.images[0]) >= 40
