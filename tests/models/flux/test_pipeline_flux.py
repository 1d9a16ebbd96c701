"""Native FLUX.1-dev vs diffusers on the same tiny checkpoint (fp32, CPU).

Pins: our transformer computes diffusers' function from diffusers' weights (name mapping + fused projections),
and our pipeline reproduces diffusers' images for the same seeds (noise, sigmas/shift, guidance, true CFG run
as one batched forward, per-request seeds inside a co-batched request batch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

pytestmark = pytest.mark.usefixtures("dist_world")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def ours(flux_dir):
    from vllm_omni.models.flux.pipeline import FluxPipeline

    od_config = OmniDiffusionConfig(model=str(flux_dir), dtype="float32")
    return FluxPipeline.from_pretrained(od_config, flux_dir, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def reference(flux_dir):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(flux_dir, dtype=torch.float32)


def test_transformer_matches_diffusers(ours, reference):
    torch.manual_seed(0)
    cfg = reference.transformer.config
    x = torch.randn(2, 16, cfg.in_channels)
    enc = torch.randn(2, 7, cfg.joint_attention_dim)
    pooled = torch.randn(2, cfg.pooled_projection_dim)
    t, g = torch.tensor([0.3, 0.9]), torch.tensor([3.5, 2.0])
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"),
                          dim=-1).reshape(16, 3)
    txt_ids = torch.zeros(7, 3)
    with torch.inference_mode():
        want = reference.transformer(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled,
                                     timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=g,
                                     return_dict=False)[0]
        got = ours.transformer(x, enc, pooled, t, img_ids=img_ids, txt_ids=txt_ids, guidance=g)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_precomputed_step_modulation_equals_inline(ours):
    """A denoise loop's adaLN table, computed for all steps and rows at once, gives each step's forward unchanged."""
    transformer = ours.transformer
    torch.manual_seed(1)
    x, enc = torch.randn(2, 16, 64), torch.randn(2, 7, transformer.context_embedder.in_features)
    pooled = torch.randn(2, transformer.time_text_embed.text_embedder.linear_1.in_features)
    g = torch.tensor([3.5, 2.0])
    rope = transformer.rotary_emb(torch.zeros(7, 3), torch.zeros(16, 3))
    steps = torch.tensor([[0.9, 0.9], [0.4, 0.4], [0.05, 0.05]])
    with torch.inference_mode():
        table = transformer.step_modulation(steps, g, pooled, torch.float32)
        for i, t in enumerate(steps):
            want = transformer(x, enc, pooled, t, guidance=g, rotary_emb=rope)
            got = transformer(x, enc, pooled, t, guidance=g, rotary_emb=rope,
                              modulation=transformer.step_slice(table, i))
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _request(prompt, seed: int, **params) -> OmniDiffusionRequest:
    sp = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=3, seed=seed, **params)
    return OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id=f"r{seed}")


def _diffusers_image(reference, prompt: str, seed: int, **kwargs) -> np.ndarray:
    out = reference(prompt=prompt, height=64, width=64, num_inference_steps=3, max_sequence_length=512,
                    generator=torch.Generator("cpu").manual_seed(seed), **kwargs)
    return np.asarray(out.images[0])


def test_batched_requests_match_diffusers(ours, reference):
    prompts = ["a photo of a cat sitting on a red chair", "the quick brown fox"]
    batch = DiffusionRequestBatch([_request(p, seed=10 + i, guidance_scale=4.0) for i, p in enumerate(prompts)])
    outputs = ours.forward(batch)
    assert [len(o.output) for o in outputs] == [1, 1]
    assert set(outputs[0].stage_durations) == {"text_encoder", "denoise", "vae_decode"}
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        want = _diffusers_image(reference, prompt, 10 + i, guidance_scale=4.0)
        got = np.asarray(out.output[0])
        assert got.shape == want.shape == (64, 64, 3)
        assert psnr(got, want) >= 40.0
    # Different seeds must give different images (noise really is per request).
    assert psnr(np.asarray(outputs[0].output[0]), np.asarray(outputs[1].output[0])) < 30.0


def test_true_cfg_batched_forward_matches_diffusers(ours, reference):
    prompt = {"prompt": "a small robot painting mountains", "negative_prompt": "blurry"}
    request = _request(prompt, seed=3, true_cfg_scale=2.5, num_outputs_per_prompt=2)
    (out,) = ours.forward(DiffusionRequestBatch([request]))
    ref = reference(prompt=prompt["prompt"], negative_prompt="blurry", true_cfg_scale=2.5, height=64, width=64,
                    num_inference_steps=3, num_images_per_prompt=2, generator=torch.Generator("cpu").manual_seed(3))
    assert len(out.output) == 2
    for got, want in zip(out.output, ref.images, strict=True):
        assert psnr(np.asarray(got), np.asarray(want)) >= 40.0


@pytest.mark.cuda
def test_accelerated_pipeline_matches_eager_on_cuda(flux_dir):
    """enforce_eager=False on CUDA: compiled blocks + one CUDA graph per image size, same images as eager."""
    from vllm_omni.models.flux.pipeline import FluxPipeline

    device = torch.device("cuda", torch.cuda.current_device())
    pipes = [FluxPipeline.from_pretrained(OmniDiffusionConfig(model=str(flux_dir), enforce_eager=eager), flux_dir,
                                          device, torch.bfloat16) for eager in (True, False)]
    for size in (64, 128, 64):
        sp = OmniDiffusionSamplingParams(height=size, width=size, num_inference_steps=3, seed=size)
        request = OmniDiffusionRequest(prompt="a red chair", sampling_params=sp, request_id=f"r{size}")
        eager, fast = (np.asarray(p.forward(DiffusionRequestBatch([request]))[0].output[0]) for p in pipes)
        assert eager.shape == fast.shape == (size, size, 3)
        assert psnr(fast, eager) >= 40.0
    assert len(pipes[1].transformer.compiled_forward.runner.graphs) == 2
