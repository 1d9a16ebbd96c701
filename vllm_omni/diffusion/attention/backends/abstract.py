"""What every diffusion attention backend provides.

Layout everywhere is (batch, seq, heads, head_dim) for q/k/v and the output; the optional mask is a boolean
key-padding mask (batch, seq_kv), True = attend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class AttentionImpl(ABC):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, softmax_scale: float, causal: bool,
                 deterministic: bool = False) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.deterministic = deterministic

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor: ...


class AttentionBackend(ABC):
    name: ClassVar[str]
    requires_package: ClassVar[str | None] = None
    """Import name of the kernel package, named in the error when it is missing."""
    install_hint: ClassVar[str] = ""
    has_deterministic_mode: ClassVar[bool] = False
    """Whether the kernels take a `deterministic` switch (`--fa-deterministic`); backends without one refuse it."""

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl]: ...

    @classmethod
    def supports_attention_mask(cls) -> bool:
        return True

    @classmethod
    def supports_multi_doc_packed_varlen(cls) -> bool:
        """True when several requests packed into one varlen sequence stay isolated from each other."""
        return False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when usable here, else why not (missing package or platform)."""
        return None

    @classmethod
    def check_available(cls) -> None:
        reason = cls.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"attention backend {cls.name} is not available: {reason}. "
                               f"Choose another with --diffusion-attention-backend / DIFFUSION_ATTENTION_BACKEND.")


def package_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def cuda_missing() -> str | None:
    return None if torch.cuda.is_available() else "it needs a CUDA GPU and none is visible"
