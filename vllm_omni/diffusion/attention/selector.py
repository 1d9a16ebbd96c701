"""Picks the attention backend for the layers of a model being built.

Resolution order: an explicit name, then the backend of the attention config current while the model is
built (the pipeline sets it from `OmniDiffusionConfig.diffusion_attention_backend`), then env
`DIFFUSION_ATTENTION_BACKEND`, then the platform default: on Hopper and newer GPUs CUDNN_ATTN, else FLASH_ATTN
when installed, else TORCH_SDPA (always TORCH_SDPA on CPU).
The choice is made once per layer at construction, never swapped while requests run.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vllm_omni import envs
from vllm_omni.diffusion.attention.backends.abstract import AttentionBackend

_BACKENDS: dict[str, str] = {
    "TORCH_SDPA": "vllm_omni.diffusion.attention.backends.sdpa:TorchSDPABackend",
    "CUDNN_ATTN": "vllm_omni.diffusion.attention.backends.cudnn:CudnnAttentionBackend",
    "FLASH_ATTN": "vllm_omni.diffusion.attention.backends.flash_attn:FlashAttentionBackend",
    "FLASHINFER_ATTN": "vllm_omni.diffusion.attention.backends.flashinfer:FlashInferAttentionBackend",
}


@dataclass(frozen=True)
class DiffusionAttentionConfig:
    backend: str | None = None
    fa_deterministic: bool = False


_current = DiffusionAttentionConfig()


@contextmanager
def set_current_attention_config(config: DiffusionAttentionConfig) -> Iterator[None]:
    """Scope in which newly built `Attention` layers use `config` (like vLLM's set_current_vllm_config)."""
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def get_current_attention_config() -> DiffusionAttentionConfig:
    return _current


def available_backends() -> list[str]:
    return list(_BACKENDS)


def load_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name` (case-insensitive), without checking availability."""
    key = name.strip().upper()
    if key not in _BACKENDS:
        raise ValueError(f"unknown diffusion attention backend {name!r}; choose one of {list(_BACKENDS)}")
    module, cls = _BACKENDS[key].split(":")
    return getattr(importlib.import_module(module), cls)


def _default() -> str:
    """On an H200 cuDNN's fused kernel ran Qwen-Image's 4224-token attention at 543 TFLOP/s, the flash kernel
    (what SDPA picks unmasked) at 322; FlashAttention-2's own package is no faster than the latter on Hopper."""
    if not torch.cuda.is_available():
        return "TORCH_SDPA"
    if torch.cuda.get_device_capability() >= (9, 0) and load_backend("CUDNN_ATTN").unavailable_reason() is None:
        return "CUDNN_ATTN"
    if load_backend("FLASH_ATTN").unavailable_reason() is None:
        return "FLASH_ATTN"
    return "TORCH_SDPA"


def get_attn_backend(name: str | None = None) -> type[AttentionBackend]:
    """The backend class for `name` (see module doc for None); raises if it cannot run here."""
    name = name or _current.backend or envs.DIFFUSION_ATTENTION_BACKEND or _default()
    backend = load_backend(name)
    backend.check_available()
    return backend
