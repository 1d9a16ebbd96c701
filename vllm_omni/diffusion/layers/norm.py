"""RMSNorm over all attention heads (diffusers' `rms_norm_across_heads`) while tensor parallelism splits them."""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)


def _head_sharded_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Load this TP rank's slice (dim 0) of a per-head vector."""
    size = param.shape[0]
    param.data.copy_(loaded_weight.narrow(0, get_tensor_model_parallel_rank() * size, size))


class HeadShardedRMSNorm(nn.Module):
    """RMSNorm over the whole (heads * head_dim) projection while each TP rank holds a slice of the heads: the
    sum of squares is all-reduced, the weight is this rank's slice (Wan's and LTX-2's q/k norms)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size // self.tp_size))
        self.weight.weight_loader = _head_sharded_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        square_sum = x.float().pow(2).sum(dim=-1, keepdim=True)
        if self.tp_size > 1:
            square_sum = tensor_model_parallel_all_reduce(square_sum)
        x = x.float() * torch.rsqrt(square_sum / self.hidden_size + self.eps)
        return (x * self.weight.float()).to(self.weight.dtype)
