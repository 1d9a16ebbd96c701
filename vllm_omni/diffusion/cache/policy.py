"""What a request's cache does: a `CachePolicy` resolved once per request from `quality`, the request's
`cache_config` override and the server's `--cache-backend` / `--cache-config`.

Resolution (every step is validated; a bad key or value is an `OmniClientError` naming `cache_config.<key>`):

    quality="lossless"                -> nothing cached, whatever the server runs (bitwise the uncached path)
    quality="high" | "fast"           -> the family's preset of that name for the server's backend
                                         (`tea_cache` when the server runs none: presets are request-scoped)
    quality omitted                   -> the server's `--cache-config` (its own "quality" key picks the preset
                                         it starts from; `{}` = the "high" preset); lossless when the server
                                         runs no cache backend
    cache_config={...} on the request -> its keys replace the preset's (a request override)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.errors import OmniClientError

CACHE_BACKENDS = ("none", "tea_cache", "cache_dit")
REQUEST_BACKEND = "tea_cache"
"""The backend quality presets use on a server started without one (ours is request-scoped)."""
CACHED_QUALITIES = ("high", "fast")

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


SCHEDULE_PRESETS: dict[str, dict[str, Any]] = {"high": {"warmup_steps": 1, "interval": 2, "cooldown_steps": 1},
                                               "fast": {"warmup_steps": 1, "interval": 3, "cooldown_steps": 1}}
"""TeaCache's fixed schedules: what a family's `quality` presets are unless it declares its own."""
DBCACHE_PRESETS: dict[str, dict[str, Any]] = {
    # Deterministic: a fixed step mask (cache-dit's `steps_mask`), DBCache F1B0 reusing on the masked steps.
    "high": {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 1, "residual_diff_threshold": 1e9,
             "max_continuous_cached_steps": 1, "enable_taylorseer": False},
    "fast": {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 1, "residual_diff_threshold": 1e9,
             "max_continuous_cached_steps": 2, "enable_taylorseer": True, "taylorseer_order": 1},
}


@dataclass(frozen=True)
class FamilyPresets:
    """One transformer family's quality presets per backend and its published TeaCache rescale polynomial.

    A family declares them in its own folder and names the function returning them in its
    `DiffusionPipelineEntry.cache_presets`; a pipeline without presets answers `quality=high/fast` with 400."""

    coefficients: tuple[float, ...]
    """TeaCache's polynomial (highest power first) mapping the probe's relative L1 change to output change."""
    tea_cache: dict[str, dict[str, Any]] = field(default_factory=lambda: SCHEDULE_PRESETS)
    cache_dit: dict[str, dict[str, Any]] = field(default_factory=lambda: DBCACHE_PRESETS)


@dataclass(frozen=True)
class CachePolicy:
    """What one request's cache does; hashable, so requests with equal policies may share a forward."""

    quality: str
    """What the request asked for: lossless | high | fast | default (the server's --cache-config)."""
    backend: str = "none"
    settings: tuple[tuple[str, Any], ...] = ()
    """The backend's settings after presets and overrides, as sorted (key, value) pairs (lists as tuples)."""
    custom: bool = False
    """The request carried its own cache_config override."""

    @property
    def active(self) -> bool:
        return self.backend != "none"

    @property
    def config(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings}

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.settings).get(key, default)

    @property
    def adaptive(self) -> bool:
        """The decision depends on the data (TeaCache threshold, DBCache residual threshold)."""
        if self.backend == "tea_cache":
            return self.get("rel_l1_thresh") is not None
        return self.backend == "cache_dit" and self.get("residual_diff_threshold", 0.0) < 1e8


LOSSLESS = CachePolicy("lossless")


@dataclass
class CacheDefaults:
    """The server side of the resolution: `--cache-backend` and the parsed `--cache-config`."""

    backend: str = "none"
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.backend = self.backend or "none"
        if self.backend not in CACHE_BACKENDS:
            raise OmniClientError(f"cache_backend must be one of {list(CACHE_BACKENDS)}, got {self.backend!r}",
                                  param="cache_backend")
        if self.config and self.backend == "none":
            raise OmniClientError("cache_config (--cache-config) needs a cache backend (--cache-backend tea_cache "
                                  "or cache_dit)", param="cache_config")
        try:
            config = dict(self.config)
            quality = config.pop("quality", "high")
            if quality not in CACHED_QUALITIES:
                raise OmniClientError(f"cache_config.quality must be one of {list(CACHED_QUALITIES)}, got "
                                      f"{quality!r}", param="cache_config.quality")
            if self.backend != "none":
                check_cache_config(config, self.backend)
            if self.backend == "tea_cache":
                _check_teacache_mode(config, config)
        except OmniClientError as exc:  # the server's setting: name its flag
            raise OmniClientError(f"--cache-config: {exc.message}", param=exc.param) from None


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
    _check_refresh_policy(config)
    if quality == "lossless" and config:
        raise OmniClientError("cache_config cannot be combined with quality='lossless': it caches nothing (force "
                              "refresh hints require an active cache backend)", param="cache_config")
    if num_steps is not None:
        check_refresh_hint(CachePolicy("request", settings=tuple(config.items())), num_steps)


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


def resolve_policy(defaults: CacheDefaults, presets: FamilyPresets | None, quality: str | None,
                   override: dict[str, Any] | None) -> CachePolicy:
    """The policy of one request (see the module docstring); `presets` None = a pipeline with no cache hooks."""
    if quality == "lossless":
        return LOSSLESS
    if quality is None and not override and defaults.backend == "none":
        return LOSSLESS
    backend = defaults.backend if defaults.backend != "none" else REQUEST_BACKEND
    if presets is None:
        raise OmniClientError(f"this model's pipeline has no cache acceleration (quality={quality!r}); use "
                              "quality='lossless' or omit it", param="quality" if quality else "cache_config")
    server = dict(defaults.config)
    preset = server.pop("quality", "high") if quality is None else quality
    settings = dict(getattr(presets, backend)[preset])
    if quality is None:
        settings.update(server)
    if override:
        check_cache_config(override, backend)
        settings.update(override)
    if backend == "tea_cache":
        _check_teacache_mode(settings, override or {})
    _check_refresh_policy(settings)
    return CachePolicy(quality or "default", backend,
                       tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items())),
                       custom=bool(override))


def _check_teacache_mode(settings: dict[str, Any], override: dict[str, Any]) -> None:
    """A fixed schedule takes `interval`, an adaptive one `rel_l1_thresh` (+ `max_cached_steps`, `coefficients`);
    a preset's interval gives way to a threshold the request sets."""
    if settings.get("rel_l1_thresh") is None:
        extra = sorted(k for k in ("max_cached_steps", "coefficients") if k in settings)
        if extra:
            raise OmniClientError(f"cache_config.{extra[0]} needs rel_l1_thresh (adaptive TeaCache)",
                                  param=f"cache_config.{extra[0]}")
    elif "interval" in override:
        raise OmniClientError("cache_config.interval (fixed schedule) cannot be combined with rel_l1_thresh "
                              "(adaptive)", param="cache_config.interval")
    else:
        settings.pop("interval", None)


def _check_refresh_policy(settings: dict[str, Any]) -> None:
    if settings.get("force_refresh_step_policy") is not None and settings.get("force_refresh_step_hint") is None:
        raise OmniClientError("cache_config.force_refresh_step_policy requires force_refresh_step_hint",
                              param="cache_config.force_refresh_step_policy")


def check_refresh_hint(policy: CachePolicy, num_steps: int) -> None:
    """The force-refresh step must be one of the request's steps after the first."""
    hint = policy.get("force_refresh_step_hint")
    if hint is not None and not 1 <= hint < num_steps:
        raise OmniClientError(f"cache_config.force_refresh_step_hint must be between 1 and {num_steps - 1} "
                              f"(num_inference_steps={num_steps}), got {hint}",
                              param="cache_config.force_refresh_step_hint")
