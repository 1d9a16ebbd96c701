"""Cache policy resolution and validation (no model): the table from (server backend, server config, request
quality, request override) to what runs, and the 400s that name the offending field."""

from __future__ import annotations

import pytest

from vllm_omni.diffusion.cache.policy import LOSSLESS, CacheDefaults, resolve_policy
from vllm_omni.diffusion.cache.state import CacheState
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP
from vllm_omni.models.qwen_image.cache import PRESETS

QWEN = PRESETS
COEFFS = PRESETS.coefficients


def policy(backend="none", server=None, quality=None, override=None, family=QWEN):
    return resolve_policy(CacheDefaults(backend, server or {}), family, quality, override)


def test_resolution_table():
    assert policy() == LOSSLESS  # no backend, no quality: uncached
    assert policy("tea_cache", quality="lossless") == LOSSLESS
    high = policy(quality="high")  # quality presets are request-scoped: tea_cache without a server backend
    assert (high.backend, high.quality, high.config) == ("tea_cache", "high",
                                                         {"cooldown_steps": 1, "interval": 2, "warmup_steps": 1})
    assert policy("tea_cache").config == high.config  # the server default {} is the high preset
    assert policy("tea_cache", {"quality": "fast"}).get("interval") == 3
    assert policy("tea_cache", {"quality": "fast"}, quality="high").get("interval") == 2  # a named quality wins
    custom = policy("tea_cache", quality="high", override={"rel_l1_thresh": 0.3})
    assert custom.custom and custom.adaptive and custom.get("interval") is None  # the threshold replaces it
    dit = policy("cache_dit", quality="high")
    assert dit.backend == "cache_dit" and dit.get("Fn_compute_blocks") == 1
    assert hash(high) != hash(custom)  # policies key request-mode groups


@pytest.mark.parametrize(("kwargs", "param", "needle"), [
    ({"cache_config": {"bogus": 1}}, "cache_config.bogus", "unknown cache_config key"),
    ({"cache_config": {"force_refresh_step_hint": True}}, "cache_config.force_refresh_step_hint", "positive integer"),
    ({"cache_config": {"force_refresh_step_hint": 0}}, "cache_config.force_refresh_step_hint", "positive integer"),
    ({"num_inference_steps": 50, "cache_config": {"force_refresh_step_hint": 51}},
     "cache_config.force_refresh_step_hint", "between 1"),
    ({"cache_config": {"force_refresh_step_hint": 3, "force_refresh_step_policy": "always"}},
     "cache_config.force_refresh_step_policy", "one of"),
    ({"cache_config": {"force_refresh_step_policy": "once"}}, "cache_config.force_refresh_step_policy",
     "requires force_refresh_step_hint"),
    ({"quality": "lossless", "cache_config": {"force_refresh_step_hint": 3}}, "cache_config",
     "require an active"),
    ({"cache_config": {"rel_l1_thresh": -1}}, "cache_config.rel_l1_thresh", "finite number"),
    ({"cache_config": {"coefficients": [1, 2]}}, "cache_config.coefficients", "5 numbers"),
    ({"cache_config": "fast"}, "cache_config", "object"),
    ({"quality": "best"}, "quality", "one of"),
])
def test_request_errors_name_the_field(kwargs, param, needle):
    with pytest.raises(OmniClientError) as info:
        SP(**kwargs)
    assert info.value.param == param and needle in info.value.message


@pytest.mark.parametrize(("backend", "server", "quality", "override", "param"), [
    ("tea_cache", None, "high", {"Fn_compute_blocks": 1}, "cache_config.Fn_compute_blocks"),  # cache-dit's key
    ("tea_cache", None, "high", {"rel_l1_thresh": 0.2, "interval": 2}, "cache_config.interval"),
    ("tea_cache", None, "high", {"max_cached_steps": 2}, "cache_config.max_cached_steps"),
    ("none", None, "high", None, "quality"),  # a family without cache hooks
])
def test_worker_side_errors_name_the_field(backend, server, quality, override, param):
    family = None if param == "quality" else QWEN
    with pytest.raises(OmniClientError) as info:
        policy(backend, server, quality, override, family)
    assert info.value.param == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"cache_backend": "tea_cache", "cache_config": {"bogus": 1}}, "cache_config.bogus"),
    ({"cache_config": {"interval": 2}}, "cache_config"),  # settings without a backend
    ({"cache_backend": "tea_cache", "cache_config": {"quality": "lossless"}}, "cache_config.quality"),
    ({"cache_backend": "cache_dit", "step_execution": True}, "cache_backend"),
])
def test_server_errors_name_the_field(kwargs, param):
    with pytest.raises(OmniClientError) as info:
        OmniDiffusionConfig(model="m", **kwargs)
    assert info.value.param == param


def test_step_signature_is_the_co_batching_key():
    high = CacheState.create(policy(quality="high"), 6, COEFFS)
    fast = CacheState.create(policy(quality="fast"), 6, COEFFS)
    adaptive = CacheState.create(policy(override={"rel_l1_thresh": 0.3}), 6, COEFFS)
    assert CacheState.create(LOSSLESS, 6, COEFFS).step_signature(2) is None
    # Fixed schedules: high computes steps 0, 1, 3, 5; fast 0, 1, 4, 5.
    assert [high.scheduled(i) for i in range(6)] == [True, True, False, True, False, True]
    assert [fast.scheduled(i) for i in range(6)] == [True, True, False, False, True, True]
    assert high.step_signature(2) != fast.step_signature(2) and high.step_signature(2) != high.step_signature(3)
    assert high.step_signature(2) == CacheState.create(policy(quality="high"), 6, COEFFS).step_signature(2)
    assert adaptive.step_signature(2) != CacheState.create(adaptive.policy, 6, COEFFS).step_signature(2)
    refresh = CacheState.create(policy(quality="fast", override={"force_refresh_step_hint": 2,
                                                                 "force_refresh_step_policy": "repeat"}), 6, COEFFS)
    assert [refresh.scheduled(i) for i in range(6)] == [True, True, True, False, True, True]
