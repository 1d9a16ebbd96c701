"""The attention layer diffusion transformers call: q/k/v in, attended values out, backend chosen once."""

from __future__ import annotations

import torch
from torch import nn

from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig, get_attn_backend


class Attention(nn.Module):
    """Multi-head attention over (batch, seq, heads, head_dim) tensors.

    `attn_mask` is a boolean key-padding mask (batch, seq_kv), True = attend. Grouped-query attention is
    used when `num_kv_heads` < `num_heads`. `attn_config` is the stage's attention config, passed down by the
    model that owns the layer (None: env / platform default, for a layer used on its own).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        prefix: str = "",
        attn_config: DiffusionAttentionConfig | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{prefix or 'Attention'}: num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.causal = causal
        self.prefix = prefix
        attn_config = attn_config or DiffusionAttentionConfig()
        self.attn_backend = get_attn_backend(attn_config.backend)
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads, head_dim, num_kv_heads, self.softmax_scale, causal, deterministic=attn_config.fa_deterministic
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attn_mask is not None and not self.attn_backend.supports_attention_mask():
            raise ValueError(f"{self.prefix}: attention backend {self.attn_backend.get_name()} does not support "
                             "attention masks")
        return self.impl.forward(query, key, value, attn_mask)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"backend={self.attn_backend.get_name()}")
