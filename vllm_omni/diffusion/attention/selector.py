"""Picks the attention backend for the layers of a model being built.

The stage's choice travels as a `DiffusionAttentionConfig` constructor argument from the component loader down
to every `Attention` layer (as vLLM passes `prefix`), never through a module global. Resolution order: the
config's backend name (from `OmniDiffusionConfig.diffusion_attention_backend`), then env
`DIFFUSION_ATTENTION_BACKEND`, then the platform default: on Hopper and newer GPUs CUDNN_ATTN, else FLASH_ATTN
when installed, else TORCH_SDPA (always TORCH_SDPA on CPU).
The choice is made once per layer at construction, never swapped while requests run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_omni import envs
from vllm_omni.diffusion.attention.backends.abstract import AttentionBackend

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

ENV_VAR = "DIFFUSION_ATTENTION_BACKEND"
FLAG = "--diffusion-attention-backend"
_BACKENDS: dict[str, str] = {
    "TORCH_SDPA": "vllm_omni.diffusion.attention.backends.sdpa:TorchSDPABackend",
    "CUDNN_ATTN": "vllm_omni.diffusion.attention.backends.cudnn:CudnnAttentionBackend",
    "FLASH_ATTN": "vllm_omni.diffusion.attention.backends.flash_attn:FlashAttentionBackend",
    "FLASHINFER_ATTN": "vllm_omni.diffusion.attention.backends.flashinfer:FlashInferAttentionBackend",
}


@dataclass(frozen=True)
class DiffusionAttentionConfig:
    """The stage's attention settings, handed to every attention layer of a model when it is built."""

    backend: str | None = None
    """Backend name; None falls back to env `DIFFUSION_ATTENTION_BACKEND`, then the platform default."""
    fa_deterministic: bool = False
    """Deterministic FlashAttention kernels (slower), for reproducible accuracy runs; refused by backends without
    such kernels (`check_deterministic`)."""

    @classmethod
    def from_od_config(cls, od_config: OmniDiffusionConfig) -> DiffusionAttentionConfig:
        """The stage's settings with the backend resolved now: a name that is unknown or cannot run here fails
        at load, naming the flag, rather than at the first request."""
        backend = get_attn_backend(od_config.diffusion_attention_backend)
        check_deterministic(backend, od_config.fa_deterministic)
        return cls(backend=backend.get_name(), fa_deterministic=od_config.fa_deterministic)


def check_deterministic(backend: type[AttentionBackend], fa_deterministic: bool) -> None:
    """`--fa-deterministic` switches FlashAttention's kernels to their deterministic variant. The SDPA-based
    backends (TORCH_SDPA, CUDNN_ATTN: the CPU and Hopper defaults) have no such switch, so the flag is refused
    there instead of being accepted and ignored."""
    if fa_deterministic and not backend.has_deterministic_mode:
        with_mode = [name for name in _BACKENDS if load_backend(name).has_deterministic_mode]
        raise ValueError(f"--fa-deterministic selects the deterministic kernels of {with_mode}; this stage's "
                         f"attention backend is {backend.get_name()}, which has none: leave the flag off or pass "
                         f"{FLAG} {with_mode[0]}")


def available_backends() -> list[str]:
    return list(_BACKENDS)


def load_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name` (case-insensitive), without checking availability."""
    key = name.strip().upper()
    if key not in _BACKENDS:
        raise ValueError(f"unknown diffusion attention backend {name!r} ({FLAG} / {ENV_VAR}); "
                         f"choose one of {list(_BACKENDS)}")
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
    backend = load_backend(name or envs.DIFFUSION_ATTENTION_BACKEND or _default())
    backend.check_available()
    return backend
