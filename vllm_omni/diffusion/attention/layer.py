"""The attention layer diffusion transformers call: q/k/v in, attended values out, backend chosen once."""

from __future__ import annotations

import torch
from torch import nn

from vllm_omni.diffusion.attention.parallel import sequence_parallel_attention
from vllm_omni.diffusion.attention.selector import DiffusionAttentionConfig, check_deterministic, get_attn_backend
from vllm_omni.diffusion.distributed.parallel_state import get_diffusion_groups


class Attention(nn.Module):
    """Multi-head attention over (batch, seq, heads, head_dim) tensors.

    `attn_mask` is a boolean key-padding mask (batch, seq_kv), True = attend. Grouped-query attention is
    used when `num_kv_heads` < `num_heads`. `attn_config` is the stage's attention config, passed down by the
    model that owns the layer (None: env / platform default, for a layer used on its own).

    Under sequence parallelism (`--ulysses-degree`, `--ring-degree`, `--allgather-degree`) a self-attention
    layer's q/k/v hold this rank's shard of the image/video tokens plus, at the front or rear (`joint_len`,
    `joint_front`), all the text tokens; the layer runs Ulysses / ring / AllGather-KV / USP attention over the
    whole sequence (see
    `attention/parallel.py`). `cross_attention=True` layers (queries from the sharded sequence, keys from
    replicated text) need no communication and attend locally.
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
        cross_attention: bool = False,
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
        check_deterministic(self.attn_backend, attn_config.fa_deterministic)
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads, head_dim, num_kv_heads, self.softmax_scale, causal, deterministic=attn_config.fa_deterministic
        )
        groups = get_diffusion_groups()
        self.sp_groups = None if cross_attention or groups is None or groups.sp.world_size == 1 else groups
        if self.sp_groups is not None:
            self._check_sequence_parallel()

    def _check_sequence_parallel(self) -> None:
        """Degrees the heads cannot take fail when the model is built (start-up), naming the flag."""
        degree, name = self.sp_groups.ulysses.world_size, self.prefix or "Attention"
        if self.num_kv_heads % degree and self.sp_groups.ulysses_mode != "advanced_uaa":
            raise ValueError(f"{name}: --ulysses-degree {degree} does not divide the "
                             f"{self.num_kv_heads} attention heads per tensor-parallel rank (query heads "
                             f"{self.num_heads}); choose a divisor of them, use --ring-degree or "
                             "--allgather-degree, or --ulysses-mode advanced_uaa (pads the heads)")
        if self.num_kv_heads % degree and self.sp_groups.ring.world_size > 1:
            raise ValueError(f"{name}: --ulysses-mode advanced_uaa with --ring-degree "
                             f"{self.sp_groups.ring.world_size} does not support K/V head padding "
                             f"({self.num_kv_heads} K/V heads, --ulysses-degree {degree}); choose a Ulysses "
                             "degree that divides the K/V heads, or --allgather-degree instead of the ring")
        if self.causal:
            raise ValueError(f"{self.prefix}: sequence parallelism does not support causal attention")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, *, joint_len: int = 0, joint_front: bool = False
                ) -> torch.Tensor:
        if attn_mask is not None and not self.attn_backend.supports_attention_mask():
            raise ValueError(f"{self.prefix}: attention backend {self.attn_backend.get_name()} does not support "
                             "attention masks")
        if self.sp_groups is None:
            return self.impl.forward(query, key, value, attn_mask)
        if attn_mask is not None:
            raise ValueError(f"{self.prefix}: sequence parallelism does not support attention masks")
        return sequence_parallel_attention(
            query, key, value, self.sp_groups, lambda q, k, v: self.impl.forward(q, k, v, None),
            self.softmax_scale, joint_len, joint_front)

    def extra_repr(self) -> str:
        sp = "" if self.sp_groups is None else (f", ulysses={self.sp_groups.ulysses.world_size}, "
                                                f"ring={self.sp_groups.ring.world_size}, "
                                                f"allgather={self.sp_groups.allgather.world_size}")
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"backend={self.attn_backend.get_name()}{sp}")
