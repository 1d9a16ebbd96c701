"""Rotary position embeddings over several position axes (FLUX-style: adjacent channel pairs rotate together)."""

from __future__ import annotations

import torch
from torch import nn


def multi_axis_rope_cos_sin(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float) -> tuple[torch.Tensor, ...]:
    """Per channel-pair cos/sin tables (S, sum(axes_dims) / 2) in float32 for integer positions `ids` (S, n_axes).

    Frequencies are computed in float64 (float32 where the device has no float64) as diffusers does, so the
    tables are bit-identical to every other column of its `FluxPosEmbed` tables (which repeat each pair's value).
    Apply them with `vllm_omni.diffusion.layers.qk_norm_rope.qk_norm_rope`.
    """
    freqs_dtype = torch.float32 if ids.device.type in ("mps", "npu") else torch.float64
    pos = ids.float()
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(axes_dims):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=freqs_dtype, device=ids.device) / dim))
        freqs = torch.outer(pos[:, axis], inv)
        cos_parts.append(freqs.cos().float())
        sin_parts.append(freqs.sin().float())
    return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


class JointRope(nn.Module):
    """The tables of text position ids then image position ids (FLUX's joint sequence) as a module: where a
    sequence-parallel plan (`distributed/sequence_plan.py`) splits the image rows."""

    def __init__(self, axes_dims: tuple[int, ...], theta: float) -> None:
        super().__init__()
        self.axes_dims, self.theta = tuple(axes_dims), float(theta)

    def forward(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return multi_axis_rope_cos_sin(torch.cat([txt_ids, img_ids], dim=0), self.axes_dims, self.theta)
