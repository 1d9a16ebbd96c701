"""Fused DiT ops compute what the unfused modules compute: q/k RMSNorm + RoPE + text/image join, and
linear + tanh-GELU. The Triton kernel is checked on the CPU through Triton's interpreter and on CUDA for real."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.layers.qk_norm_rope import qk_norm_rope


def _unfused(qkv, norms, freqs, heads):
    """diffusers' Qwen-Image path: RMSNorm modules, complex RoPE, then q/k/v."""
    from diffusers.models.transformers.transformer_qwenimage import RMSNorm, apply_rotary_emb_qwen

    head_dim = norms[0].shape[0]
    q, k, v = qkv.unflatten(-1, (3, heads, head_dim)).unbind(2)
    out = []
    for x, weight in ((q, norms[0]), (k, norms[1])):
        norm = RMSNorm(head_dim, eps=1e-6)
        norm.weight.data.copy_(weight)
        out.append(apply_rotary_emb_qwen(norm(x), freqs, use_real=False))
    return out[0], out[1], v


def _case(batch=2, heads=3, head_dim=32, txt_len=5, img_len=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 3 * heads * head_dim
    # The text projection is a strided view, as a fused q/k/v/MLP projection's first columns are.
    txt = torch.randn(batch, txt_len, width + 7, generator=g)[..., :width]
    img = torch.randn(batch, img_len, width, generator=g)
    norms = [torch.rand(head_dim, generator=g) + 0.5 for _ in range(4)]
    angles = [torch.rand(n, head_dim // 2, generator=g) * 6 for n in (txt_len, img_len)]
    return txt, img, norms, angles, heads


def test_reference_path_matches_diffusers_modules():
    txt, img, norms, angles, heads = _case()
    q, k, v = qk_norm_rope(img, (norms[2], norms[3]), (angles[1].cos(), angles[1].sin()), num_heads=heads,
                           eps=1e-6, txt_qkv=txt, txt_norms=(norms[0], norms[1]),
                           txt_rope=(angles[0].cos(), angles[0].sin()))
    polar = [torch.polar(torch.ones_like(a), a) for a in angles]
    want_txt = _unfused(txt, norms[:2], polar[0], heads)
    want_img = _unfused(img, norms[2:], polar[1], heads)
    for got, t, i in zip((q, k, v), want_txt, want_img, strict=True):
        torch.testing.assert_close(got, torch.cat([t, i], dim=1), atol=1e-5, rtol=1e-5)
    # One stream only (FLUX single blocks: the sequence is already joined).
    q1, k1, v1 = qk_norm_rope(img, (norms[2], norms[3]), (angles[1].cos(), angles[1].sin()), num_heads=heads,
                              eps=1e-6)
    torch.testing.assert_close((q1, k1, v1), (q[:, 5:], k[:, 5:], v[:, 5:]))


def test_triton_kernel_matches_reference_in_interpreter(tmp_path):
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from vllm_omni.diffusion.layers import qk_norm_rope as m
        torch.manual_seed(0)
        B, H, D = 2, 3, 32
        txt = torch.randn(B, 5, 3 * H * D + 7)[..., : 3 * H * D]
        img = torch.randn(B, 9, 3 * H * D)
        w = [torch.randn(D) for _ in range(4)]
        tables = []
        for n in (5, 9):
            a = torch.rand(n, D // 2) * 6
            tables.append((a.cos(), a.sin()))
        both = [(txt, (w[0], w[1]), tables[0]), (img, (w[2], w[3]), tables[1])]
        for segments in (both, both[1:]):  # text + image in one launch; one already joined stream
            want = [torch.cat(p, 1) for p in zip(*[m._reference_segment(x, ww, r, H, 1e-6) for x, ww, r in segments])]
            got = m._triton_qk_norm_rope(segments, H, 1e-6)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-2000:]


def test_linear_gelu_tanh_off_cuda_is_linear_then_gelu(dist_world):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from vllm_omni.diffusion.layers.gelu_linear import linear_gelu_tanh

    layer = ColumnParallelLinear(16, 24, bias=True, gather_output=False, return_bias=False)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    want_fn = lambda x: F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh")  # noqa: E731
    x = torch.randn(2, 3, 16)
    want = want_fn(x)
    layer.quant_method.process_weights_after_loading(layer)  # the CPU GEMM repacks its weights
    torch.testing.assert_close(linear_gelu_tanh(layer, x), want)


@pytest.mark.cuda
def test_cuda_ops_match_reference(dist_world):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from vllm_omni.diffusion.layers.gelu_linear import linear_gelu_tanh

    txt, img, norms, angles, heads = _case(batch=2, heads=24, head_dim=128, txt_len=77, img_len=256)
    dev = torch.device("cuda")
    args = dict(num_heads=heads, eps=1e-6, txt_qkv=txt.to(dev, torch.bfloat16),
                txt_norms=(norms[0].to(dev), norms[1].to(dev)),
                txt_rope=(angles[0].cos().to(dev), angles[0].sin().to(dev)))
    img_args = (img.to(dev, torch.bfloat16), (norms[2].to(dev), norms[3].to(dev)),
                (angles[1].cos().to(dev), angles[1].sin().to(dev)))
    got = qk_norm_rope(*img_args, **args)
    want = qk_norm_rope(*(a.cpu() if torch.is_tensor(a) else tuple(t.cpu() for t in a) for a in img_args),
                        **{k: (v.cpu() if torch.is_tensor(v) else tuple(t.cpu() for t in v) if isinstance(v, tuple)
                               else v) for k, v in args.items()})
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu().float(), b.float(), atol=2e-2, rtol=2e-2)

    with torch.device(dev):
        layer = ColumnParallelLinear(3072, 4 * 3072, bias=True, gather_output=False, return_bias=False,
                                     params_dtype=torch.bfloat16)
        torch.nn.init.normal_(layer.weight, std=0.02)
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(4, 300, 3072, device=dev, dtype=torch.bfloat16)
    want = F.gelu(F.linear(x, layer.weight, layer.bias).float(), approximate="tanh")
    torch.testing.assert_close(linear_gelu_tanh(layer, x).float(), want, atol=3e-2, rtol=2e-2)
