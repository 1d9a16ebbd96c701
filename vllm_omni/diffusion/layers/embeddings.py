"""Timestep and pooled-text conditioning embedders shared by DiT models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_sinusoid(timesteps: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """(N,) -> (N, dim) float32 [cos | sin] features (diffusers `Timesteps(flip_sin_to_cos=True, shift=0)`)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    args = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers `TimestepEmbedding` and `PixArtAlphaTextProjection` weights)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))
