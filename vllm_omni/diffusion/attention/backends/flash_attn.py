"""FlashAttention (`flash_attn` package); masked batches run through the varlen kernel."""

from __future__ import annotations

import torch

from vllm_omni.diffusion.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    cuda_missing,
    package_missing,
)


class FlashAttentionImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        from flash_attn import flash_attn_func

        if attn_mask is None:
            return _unwrap(flash_attn_func(query, key, value, softmax_scale=self.softmax_scale, causal=self.causal,
                                           deterministic=self.deterministic))
        return self._forward_varlen_masked(query, key, value, attn_mask)

    def _forward_varlen_masked(self, query, key, value, attn_mask):
        """Drop padded keys per sample and run the varlen kernel (max_seqlen_k: the padded length, a valid bound)."""
        from flash_attn import flash_attn_varlen_func

        batch, seq_q = query.shape[:2]
        kv_lens = attn_mask.sum(dim=1, dtype=torch.int32)
        cu_k = torch.nn.functional.pad(kv_lens.cumsum(0, dtype=torch.int32), (1, 0))
        cu_q = torch.arange(0, (batch + 1) * seq_q, seq_q, dtype=torch.int32, device=query.device)
        out = flash_attn_varlen_func(
            query.flatten(0, 1), key[attn_mask], value[attn_mask], cu_q, cu_k, seq_q, key.shape[1],
            softmax_scale=self.softmax_scale, causal=self.causal, deterministic=self.deterministic,
        )
        return _unwrap(out).unflatten(0, (batch, seq_q))


def _unwrap(out):
    # FA3 returns (out, lse).
    return out[0] if isinstance(out, tuple) else out


class FlashAttentionBackend(AttentionBackend):
    name = "FLASH_ATTN"
    requires_package = "flash_attn"
    install_hint = "pip install flash-attn --no-build-isolation"
    has_deterministic_mode = True

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return FlashAttentionImpl

    @classmethod
    def supports_multi_doc_packed_varlen(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if package_missing("flash_attn"):
            return f"the 'flash_attn' package is not installed ({cls.install_hint})"
        return cuda_missing()
