"""FlashInfer single-sequence prefill kernels, one call per sample (padded keys sliced off)."""

from __future__ import annotations

import torch

from vllm_omni.diffusion.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    cuda_missing,
    package_missing,
)


class FlashInferAttentionImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        from flashinfer.prefill import single_prefill_with_kv_cache

        outs = []
        for b in range(query.shape[0]):
            k, v = (key[b], value[b]) if attn_mask is None else (key[b][attn_mask[b]], value[b][attn_mask[b]])
            outs.append(single_prefill_with_kv_cache(query[b], k, v, causal=self.causal,
                                                     sm_scale=self.softmax_scale, kv_layout="NHD"))
        return torch.stack(outs)


class FlashInferAttentionBackend(AttentionBackend):
    name = "FLASHINFER_ATTN"
    requires_package = "flashinfer"
    install_hint = "pip install flashinfer-python"

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return FlashInferAttentionImpl

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if package_missing("flashinfer"):
            return f"the 'flashinfer' package is not installed ({cls.install_hint})"
        return cuda_missing()
