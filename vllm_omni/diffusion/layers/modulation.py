"""adaLN-Zero modulation and gated residuals, written as small pure functions so compile can fuse them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm without affine, then `* (1 + scale) + shift` broadcast over the sequence (x: B, S, D)."""
    x = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return x * (1 + scale[:, None]) + shift[:, None]


def gated_residual(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`residual + gate * y` with a per-sample gate (B, D) broadcast over the sequence."""
    return residual + gate[:, None] * y


class AdaLNModulation(nn.Module):
    """`linear(silu(temb))`: the `num_chunks` (B, D) shift/scale/gate sets of an adaLN block, side by side."""

    def __init__(self, dim: int, num_chunks: int, *, cond_dim: int | None = None, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(cond_dim or dim, num_chunks * dim, bias=bias)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(temb))
