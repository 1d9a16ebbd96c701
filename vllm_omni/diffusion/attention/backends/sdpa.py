"""PyTorch scaled_dot_product_attention: works everywhere, the default on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.attention.backends.abstract import AttentionBackend, AttentionImpl


class TorchSDPAImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        mask = None if attn_mask is None else attn_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=mask,
            is_causal=self.causal,
            scale=self.softmax_scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return out.transpose(1, 2)


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchSDPAImpl
