"""Rotary position embeddings over several position axes (FLUX-style interleaved pairs)."""

from __future__ import annotations

import torch


def multi_axis_rope_cos_sin(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float) -> tuple[torch.Tensor, ...]:
    """cos/sin tables (S, sum(axes_dims)) in float32 for integer positions `ids` (S, n_axes).

    Frequencies are computed in float64 (float32 where the device has no float64) as diffusers does, so the
    tables are bit-identical to its `FluxPosEmbed`.
    """
    freqs_dtype = torch.float32 if ids.device.type in ("mps", "npu") else torch.float64
    pos = ids.float()
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=freqs_dtype, device=ids.device) / dim))
        freqs = torch.outer(pos[:, axis], inv)
        cos_parts.append(freqs.cos().repeat_interleave(2, dim=1).float())
        sin_parts.append(freqs.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) channel pairs of x (B, S, H, D) by tables (S, D); math in float32, result in x.dtype."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
