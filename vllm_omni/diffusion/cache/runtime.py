"""The glue a native pipeline calls: a request's policy, its cache state, its cache group and the cached
transformer call."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from torch import nn

from vllm_omni.diffusion.cache.policy import (
    FAMILY_PRESETS,
    WAN_14B_COEFFICIENTS,
    CacheDefaults,
    CachePolicy,
    check_refresh_hint,
    resolve_policy,
)
from vllm_omni.diffusion.cache.state import BlockCache, CacheState

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams



def request_policy(od_config: OmniDiffusionConfig, transformer: nn.Module | None,
                   sp: OmniDiffusionSamplingParams) -> CachePolicy:
    """The request's policy on this stage (OmniClientError naming the field when it cannot have one)."""
    family = type(transformer).__name__ if transformer is not None else None
    defaults = CacheDefaults(od_config.cache_backend or "none", od_config.cache_config)
    return resolve_policy(defaults, family, sp.quality, sp.cache_config)


def cache_group(policy: CachePolicy, request: Any) -> Hashable:
    """Part of a request-mode group key: requests with an adaptive policy decide from their own rows, so each
    runs in a group of its own; equal fixed policies share forwards."""
    return ("alone", id(request)) if policy.adaptive else policy


def cache_state_for(policy: CachePolicy, transformer: nn.Module | None, num_steps: int) -> CacheState:
    check_refresh_hint(policy, num_steps)
    return CacheState.create(policy, num_steps, type(transformer).__name__, _coefficients(transformer))


def _coefficients(transformer: nn.Module | None) -> tuple[float, ...] | None:
    family = type(transformer).__name__
    if family not in FAMILY_PRESETS:
        return None
    if family == "WanTransformer3DModel" and transformer.config.inner_dim >= 5120:
        return WAN_14B_COEFFICIENTS  # TeaCache4Wan2.1's 14B calibration
    return FAMILY_PRESETS[family].coefficients


def call_transformer(model: nn.Module, cache: BlockCache | None, *args: Any, **kwargs: Any) -> Any:
    """`model(*args, **kwargs)`, with `cache=` when a step is cached.

    A cached forward branches on its data and keeps residuals, so it calls the module's own `forward`, not a
    CUDA graph runner that may have replaced `model.forward` (compiled blocks still apply); uncached steps
    take exactly the path they take without a cache backend."""
    if cache is None:
        return model(*args, **kwargs)
    return type(model).forward(model, *args, cache=cache, **kwargs)
