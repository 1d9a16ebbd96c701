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

from dataclasses import dataclass, field
from typing import Any

from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.cache_config import check_cache_config, check_refresh_policy

CACHE_BACKENDS = ("none", "tea_cache", "cache_dit")
REQUEST_BACKEND = "tea_cache"
"""The backend quality presets use on a server started without one (ours is request-scoped)."""
CACHED_QUALITIES = ("high", "fast")

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
    check_refresh_policy(settings)
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
