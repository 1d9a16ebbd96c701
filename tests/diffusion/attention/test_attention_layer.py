"""Pins the Attention layer contract: (B, S, H, D) layout, key-padding masks, GQA, backend selection errors."""

from __future__ import annotations

import pytest
import torch

from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig, get_attn_backend, load_backend


def _naive(q, k, v, mask=None, scale=None, causal=False):
    """Plain softmax(QK^T)V in (B, S, H, D), with key-padding mask and GQA by head repetition."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _qkv(b=2, s=7, h=4, d=32, kv_heads=None, s_kv=None):
    g = torch.Generator().manual_seed(0)
    kv_heads = kv_heads or h
    s_kv = s_kv or s
    return (torch.randn(b, s, h, d, generator=g), torch.randn(b, s_kv, kv_heads, d, generator=g),
            torch.randn(b, s_kv, kv_heads, d, generator=g))


def test_sdpa_matches_naive_reference():
    q, k, v = _qkv()
    attn = Attention(4, 32, attn_config=DiffusionAttentionConfig("TORCH_SDPA"))
    out = attn(q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _naive(q, k, v), atol=1e-5, rtol=1e-5)


def test_key_padding_mask_ignores_padded_keys():
    q, k, v = _qkv(s=5, s_kv=9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, 2:4] = False  # non-contiguous holes are allowed too
    out = Attention(4, 32)(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, _naive(q, k, v, mask), atol=1e-5, rtol=1e-5)
    # Changing what sits under the mask changes nothing.
    k2 = k.clone()
    k2[0, 6:] = 100.0
    torch.testing.assert_close(Attention(4, 32)(q, k2, v, attn_mask=mask), out)


def test_gqa_scale_and_causal():
    q, k, v = _qkv(h=4, kv_heads=2)
    out = Attention(4, 32, num_kv_heads=2, softmax_scale=0.1, causal=True)(q, k, v)
    torch.testing.assert_close(out, _naive(q, k, v, scale=0.1, causal=True), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        Attention(4, 32, num_kv_heads=3, prefix="blocks.0.attn")


def test_selection_by_env_and_passed_config(monkeypatch):
    monkeypatch.delenv("DIFFUSION_ATTENTION_BACKEND", raising=False)
    # The platform default: SDPA on CPU; cuDNN on an H200 (the selector's docstring; found on the GPU box).
    default = "TORCH_SDPA"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        default = "CUDNN_ATTN"
    assert get_attn_backend().get_name() == default
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "torch_sdpa")
    assert Attention(2, 32).attn_backend.get_name() == "TORCH_SDPA"
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "NOPE")
    with pytest.raises(ValueError, match="unknown diffusion attention backend 'NOPE'"):
        Attention(2, 32)
    # The config passed at build time wins over the env var.
    assert Attention(2, 32, attn_config=DiffusionAttentionConfig("TORCH_SDPA")).attn_backend.get_name() == "TORCH_SDPA"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error messages")
@pytest.mark.parametrize(
    ("name", "needle"),
    [("CUDNN_ATTN", "CUDA GPU"), ("FLASH_ATTN", "flash_attn"), ("FLASHINFER_ATTN", "flashinfer")],
)
def test_unavailable_backend_names_what_is_missing(name, needle):
    with pytest.raises(RuntimeError, match=f"{name} is not available: .*{needle}"):
        Attention(2, 32, attn_config=DiffusionAttentionConfig(name))


def test_capability_flags():
    assert get_attn_backend("TORCH_SDPA").supports_attention_mask()
    assert not get_attn_backend("TORCH_SDPA").supports_multi_doc_packed_varlen()


def _cuda_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    names = ["TORCH_SDPA", "CUDNN_ATTN", "FLASH_ATTN", "FLASHINFER_ATTN"]
    return [n for n in names if load_backend(n).unavailable_reason() is None]


@pytest.mark.cuda
@pytest.mark.parametrize("name", _cuda_backends() or ["TORCH_SDPA"])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_backend_matches_naive_reference(name, masked):
    q, k, v = (t.cuda().bfloat16() for t in _qkv(b=2, s=40, h=4, d=64, kv_heads=4, s_kv=56))
    mask = None
    if masked:
        mask = torch.ones(2, 56, dtype=torch.bool, device="cuda")
        mask[0, 30:] = False
    out = Attention(4, 64, attn_config=DiffusionAttentionConfig(name))(q, k, v, attn_mask=mask)
    ref = _naive(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_fa_deterministic_is_refused_by_backends_without_deterministic_kernels():
    """`--fa-deterministic` reached only FLASH_ATTN's kernels: under the CPU / Hopper defaults it was accepted and
    ignored. Now it is refused, naming the flag and the backend; FLASH_ATTN (the one with the switch) keeps it."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    with pytest.raises(ValueError, match="--fa-deterministic .* backend is TORCH_SDPA"):
        Attention(2, 32, attn_config=DiffusionAttentionConfig("TORCH_SDPA", fa_deterministic=True))
    with pytest.raises(ValueError, match="--fa-deterministic .*--diffusion-attention-backend FLASH_ATTN"):
        DiffusionAttentionConfig.from_od_config(OmniDiffusionConfig(model="m", diffusion_attention_backend="TORCH_SDPA",
                                                                    fa_deterministic=True))
    assert load_backend("FLASH_ATTN").has_deterministic_mode
    assert not any(load_backend(n).has_deterministic_mode for n in ("TORCH_SDPA", "CUDNN_ATTN", "FLASHINFER_ATTN"))
