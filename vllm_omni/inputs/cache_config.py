"""The request side of cache settings: which `cache_config` keys each backend takes and their checks, run when
the request is made (`OmniDiffusionSamplingParams`) and again when the policy is resolved
(`vllm_omni/diffusion/cache/policy.py`)."""

from __future__ import annotations

import math
from typing import Any

from vllm_omni.errors import OmniClientError

TEA_CACHE_KEYS: dict[str, type] = {
    "warmup_steps": int,
    "cooldown_steps": int,
    "interval": int,
    "rel_l1_thresh": float,
    "coefficients": list,
    "max_cached_steps": int,
}
"""TeaCache settings. A fixed schedule (no `rel_l1_thresh`): step `i` runs the blocks iff `i < warmup_steps`,
`i >= steps - cooldown_steps` or `(i - warmup_steps) % interval == 0`. Adaptive (`rel_l1_thresh` set): the
blocks run once the accumulated rescaled L1 change of the probe reaches the threshold, or after
`max_cached_steps` reused steps in a row."""
CACHE_DIT_KEYS: dict[str, type] = {
    "Fn_compute_blocks": int,
    "Bn_compute_blocks": int,
    "max_warmup_steps": int,
    "max_cached_steps": int,
    "max_continuous_cached_steps": int,
    "residual_diff_threshold": float,
    "enable_taylorseer": bool,
    "taylorseer_order": int,
    "steps_computation_mask": list,
}
"""cache-dit `DBCacheConfig` fields (and its TaylorSeer calibrator) a request may set."""
COMMON_KEYS: dict[str, type] = {"force_refresh_step_hint": int, "force_refresh_step_policy": str}
"""Force a full compute at step `hint` ("once") or at every multiple of it ("repeat")."""
REFRESH_POLICIES = ("once", "repeat")
BACKEND_KEYS = {"tea_cache": TEA_CACHE_KEYS | COMMON_KEYS, "cache_dit": CACHE_DIT_KEYS | COMMON_KEYS}
ALL_KEYS = TEA_CACHE_KEYS | CACHE_DIT_KEYS | COMMON_KEYS


def check_cache_config(config: Any, backend: str | None = None) -> None:
    """Types and ranges of a cache_config; keys of `backend` only (None: of any backend)."""
    if not isinstance(config, dict):
        raise OmniClientError(f"cache_config must be an object, got {config!r}", param="cache_config")
    allowed = ALL_KEYS if backend is None else BACKEND_KEYS[backend]
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        where = "" if backend is None else f" for cache backend {backend!r}"
        raise OmniClientError(f"unknown cache_config key(s){where}: {unknown}; known: {sorted(allowed)}",
                              param=f"cache_config.{unknown[0]}")
    for key, value in config.items():
        _check_setting(key, value, allowed[key])


def check_request_cache_config(config: Any, quality: str | None, num_steps: int | None) -> None:
    """What a request's cache_config can be checked for before it reaches a worker."""
    check_cache_config(config)
    check_refresh_policy(config)
    if quality == "lossless" and config:
        raise OmniClientError("cache_config cannot be combined with quality='lossless': it caches nothing (force "
                              "refresh hints require an active cache backend)", param="cache_config")
    if num_steps is not None:
        check_refresh_hint(config, num_steps)


def _check_setting(key: str, value: Any, kind: type) -> None:
    param = f"cache_config.{key}"
    if kind is int:
        low = 1 if key in ("interval", "force_refresh_step_hint", "taylorseer_order") else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise OmniClientError(f"{param} must be a {'positive' if low else 'non-negative'} integer, got {value!r}",
                                  param=param)
    elif kind is float:
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise OmniClientError(f"{param} must be a finite number >= 0, got {value!r}", param=param)
    elif kind is bool and not isinstance(value, bool):
        raise OmniClientError(f"{param} must be a boolean, got {value!r}", param=param)
    elif kind is str and value not in REFRESH_POLICIES:
        raise OmniClientError(f"{param} must be one of {list(REFRESH_POLICIES)}, got {value!r}", param=param)
    elif kind is list:
        _check_list(key, value, param)


def _check_list(key: str, value: Any, param: str) -> None:
    if not isinstance(value, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        raise OmniClientError(f"{param} must be a list of numbers, got {value!r}", param=param)
    if key == "coefficients" and len(value) != 5:
        raise OmniClientError(f"{param} must have 5 numbers (a degree-4 polynomial), got {len(value)}", param=param)
    if key == "steps_computation_mask" and not all(v in (0, 1) for v in value):
        raise OmniClientError(f"{param} must be a list of 0 / 1 (1 = compute), got {value!r}", param=param)


def check_refresh_policy(settings: dict[str, Any]) -> None:
    if settings.get("force_refresh_step_policy") is not None and settings.get("force_refresh_step_hint") is None:
        raise OmniClientError("cache_config.force_refresh_step_policy requires force_refresh_step_hint",
                              param="cache_config.force_refresh_step_policy")


def check_refresh_hint(settings: Any, num_steps: int) -> None:
    """The force-refresh step must be one of the request's steps after the first (`settings`: a cache_config
    dict or a `CachePolicy`)."""
    hint = settings.get("force_refresh_step_hint")
    if hint is not None and not 1 <= hint < num_steps:
        raise OmniClientError(f"cache_config.force_refresh_step_hint must be between 1 and {num_steps - 1} "
                              f"(num_inference_steps={num_steps}), got {hint}",
                              param="cache_config.force_refresh_step_hint")
