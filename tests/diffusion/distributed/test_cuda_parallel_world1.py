"""The parallel code's CUDA paths on one GPU: an NCCL world of one rank (issue 19; the two-GPU kind is not lent).

What one GPU can exercise: the diffusion groups built over NCCL (and the gloo failure-exchange group beside
them); the Ulysses all-to-alls, the AllGather-KV / CFG / sequence all-gathers and the ring loop on CUDA tensors
through those groups; the ring kernel's log-sum-exp merge of K/V blocks on CUDA (fp32 and bf16) against SDPA;
the VAE patch-parallel strip decode (one strip, its cached causal convs) against `vae.decode`; and the tiny
Qwen-Image, FLUX and Wan2.1 pipelines on CUDA with every attention layer forced onto the sequence-parallel
path (`Attention.sp_groups` set to the world-1 groups), equal to the plain run. Run this module alone (it owns
the process's NCCL world): `source .gpu/bootstrap.sh && python -m pytest -q tests/diffusion/distributed/
test_cuda_parallel_world1.py`; it takes well under two minutes on an H200.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PIPELINES = {
    "qwen-image": ({"prompt": "a red cube", "negative_prompt": "blurry"},
                   dict(height=64, width=64, num_inference_steps=2, seed=0, true_cfg_scale=4.0, output_type="np")),
    "flux": ({"prompt": "a red cube"}, dict(height=64, width=64, num_inference_steps=2, seed=0, output_type="np")),
    "wan2.1-t2v": ({"prompt": "a cat walks", "negative_prompt": "blurry"},
                   dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=0, max_sequence_length=16)),
}


@pytest.fixture(scope="module")
def groups():
    from vllm.config import set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        destroy_diffusion_distributed,
        get_diffusion_groups,
        init_diffusion_distributed,
    )

    if model_parallel_is_initialized():
        pytest.skip("another module owns this process's distributed world; run this module alone")
    config = init_diffusion_distributed(rank=0, world_size=1, parallel_config=DiffusionParallelConfig(),
                                        device=torch.device("cuda", 0))
    try:
        with set_current_vllm_config(config):
            yield get_diffusion_groups()
    finally:
        destroy_diffusion_distributed()


def _qkv(dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, seq: int = 24):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, seq, heads, 16, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(2, seq, kv_heads, 16, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                          enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)


def test_groups_are_nccl(groups):
    from vllm.distributed.parallel_state import get_world_group

    assert get_world_group().world_size == 1
    for name in ("ulysses", "ring", "allgather", "sp", "cfg", "vae"):
        assert torch.distributed.get_backend(getattr(groups, name).device_group) == "nccl", name
    assert torch.distributed.get_backend(groups.failures) == "gloo"


def test_collectives_on_cuda_tensors(groups):
    from vllm_omni.diffusion.distributed.rank_errors import agree_on_failures
    from vllm_omni.diffusion.distributed.sequence import heads_to_seq, seq_to_heads

    x = torch.randn(2, 12, 4, 8, device="cuda")
    heads = seq_to_heads(x, groups.ulysses)  # NCCL all-to-all
    torch.testing.assert_close(heads_to_seq(heads.contiguous(), groups.ulysses), x, rtol=0, atol=0)
    for name in ("allgather", "cfg", "sp", "vae"):
        torch.testing.assert_close(getattr(groups, name).all_gather(x, dim=1), x, rtol=0, atol=0)
    assert agree_on_failures({}) == {}


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_ring_kernel_merge_on_cuda(groups, dtype, atol):
    from vllm_omni.diffusion.attention.parallel import attention_with_lse, ring_attention

    q, k, v = _qkv(dtype)
    want = _sdpa(q.float(), k.float(), v.float())
    scale = q.shape[-1] ** -0.5
    out = lse = None
    for block in range(3):  # what the ring loop does with three ranks' K/V blocks, merged by log-sum-exp
        rows = slice(8 * block, 8 * (block + 1))
        block_out, block_lse = attention_with_lse(q, k[:, rows], v[:, rows], scale)
        if out is None:
            out, lse = block_out, block_lse
        else:
            new_lse = torch.logaddexp(lse, block_lse)
            out = out * (lse - new_lse).exp().transpose(1, 2) + block_out * (block_lse - new_lse).exp().transpose(1, 2)
            lse = new_lse
    torch.testing.assert_close(out, want, rtol=0, atol=atol)
    ring = ring_attention(q, k[:, 8:], v[:, 8:], groups.ring, scale, joint_kv=(k[:, :8], v[:, :8]))
    torch.testing.assert_close(ring.float(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("front", [False, True])
def test_sequence_parallel_attention_on_cuda(groups, front):
    from vllm_omni.diffusion.attention.parallel import sequence_parallel_attention

    q, k, v = _qkv(torch.float32)
    out = sequence_parallel_attention(q, k, v, groups, _sdpa, q.shape[-1] ** -0.5, joint_len=5, joint_front=front)
    torch.testing.assert_close(out, _sdpa(q, k, v), rtol=0, atol=1e-5)


def test_vae_strip_decode_on_cuda(groups):
    from diffusers import AutoencoderKLQwenImage

    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.distributed.vae_patch import patch_parallel_decode

    vae = AutoencoderKLQwenImage.from_pretrained(str(build_tiny("qwen-image")), subfolder="vae",
                                                 torch_dtype=torch.float32).to("cuda").eval()
    latents = torch.randn(1, 16, 1, 28, 4, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.inference_mode():
        want = vae.decode(latents, return_dict=False)[0].clamp(-1.0, 1.0)
        got = patch_parallel_decode(vae, latents, groups.vae)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _run(pipe, od_config, prompt: dict, params: dict) -> np.ndarray:
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.step_context import StepContext
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    request = OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), "r0")
    ctx = StepContext(od_config, request_ids=["r0"])
    with torch.inference_mode():
        state = pipe.prepare([request], ctx)
        pipe.denoise(state, ctx)
        (out,) = pipe.finish(state, ctx)
    assert out.error is None, out.error
    output = out.output["video"] if isinstance(out.output, dict) else out.output
    return np.asarray(output, dtype=np.float64)


@pytest.mark.parametrize("model", list(PIPELINES))
def test_pipeline_on_the_parallel_attention_path_equals_plain_run(groups, model):
    from vllm_omni.catalog.tiny import build_tiny
    from vllm_omni.diffusion.attention.layer import Attention
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    od_config = OmniDiffusionConfig(model=str(build_tiny(model)), dtype="float32",
                                    diffusion_attention_backend="TORCH_SDPA")
    runner = DiffusionModelRunner(od_config, torch.device("cuda", 0))
    runner.load_model()
    prompt, params = PIPELINES[model]
    plain = _run(runner.pipeline, od_config, prompt, params)
    layers = [m for m in runner.pipeline.modules() if isinstance(m, Attention)]
    assert layers and all(layer.sp_groups is None for layer in layers)  # one rank: the plain path
    for layer in layers:
        layer.sp_groups = groups
    parallel = _run(runner.pipeline, od_config, prompt, params)
    assert plain.std() > 0
    mse = float(np.mean((parallel - plain) ** 2))
    assert mse == 0 or 10 * np.log10(float(np.abs(plain).max()) ** 2 / mse) >= 60.0
