"""SDPA pinned to the cuDNN fused kernel (fast with masks on recent NVIDIA GPUs)."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vllm_omni.diffusion.attention.backends.abstract import AttentionBackend, AttentionImpl, cuda_missing
from vllm_omni.diffusion.attention.backends.sdpa import TorchSDPAImpl

# cuDNN first; the others only for shapes its fused kernel does not take (e.g. unusual head sizes).
_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CudnnAttentionImpl(TorchSDPAImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        fast_path_shape = query.shape[-1] % 8 == 0 and query.shape[-1] <= 128
        if attn_mask is None and self.num_kv_heads == self.num_heads and fast_path_shape:
            # The aten kernel itself, not SDPA under a context manager: torch.compile traces it as one node.
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, False,
                is_causal=self.causal, scale=self.softmax_scale,
            )[0]
            return out.transpose(1, 2)
        with sdpa_kernel(_PRIORITY, set_priority=True):
            return super().forward(query, key, value, attn_mask)


class CudnnAttentionBackend(AttentionBackend):
    name = "CUDNN_ATTN"

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return CudnnAttentionImpl

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if (reason := cuda_missing()) is not None:
            return reason
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this PyTorch build"
        return None
