"""The glue a native pipeline calls: a request's policy, its cache state, its cache group and the cached
transformer call."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from torch import nn

from vllm_omni.diffusion.cache import cachedit
from vllm_omni.diffusion.cache.policy import (
    CacheDefaults,
    CachePolicy,
    FamilyPresets,
    resolve_policy,
)
from vllm_omni.diffusion.cache.state import CacheState
from vllm_omni.diffusion.layers.compile import call_compiled
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.cache_config import check_refresh_hint

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.state import DenoiseState
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams



def request_policy(od_config: OmniDiffusionConfig, presets: FamilyPresets | None,
                   sp: OmniDiffusionSamplingParams) -> CachePolicy:
    """The request's policy on this stage (OmniClientError naming the field when it cannot have one)."""
    defaults = CacheDefaults(od_config.cache_backend or "none", od_config.cache_config)
    return resolve_policy(defaults, presets, sp.quality, sp.cache_config)


def cache_group(policy: CachePolicy, request: Any) -> Hashable:
    """Part of a request-mode group key: requests with an adaptive policy decide from their own rows, so each
    runs in a group of its own; equal fixed policies share forwards."""
    return ("alone", id(request)) if policy.adaptive else policy


def cache_state_for(policy: CachePolicy, transformers: dict[str, nn.Module], num_steps: int,
                    presets: FamilyPresets | None) -> CacheState:
    """A request group's cache state; a cache-dit group gets fresh cache-dit contexts with its config."""
    check_refresh_hint(policy, num_steps)
    state = CacheState.create(policy, num_steps, presets.coefficients if presets is not None else ())
    if policy.backend == "cache_dit":
        if len(transformers) > 1:  # its stats stayed empty on Wan2.2's second expert: not counted, not offered
            raise OmniClientError("cache_backend='cache_dit' does not support two-expert models (Wan2.2 A14B) yet; "
                                  "use quality='lossless' here, or serve with --cache-backend tea_cache",
                                  status_code=422, param="quality")
        if not all(hasattr(t, "cache_dit_block_lists") for t in transformers.values()):
            raise OmniClientError("cache_backend='cache_dit' does not cover this model's transformer yet; use "
                                  "quality='lossless' here, or serve with --cache-backend tea_cache",
                                  status_code=422, param="quality")
        state.backend_state = cachedit.refresh(transformers, policy, num_steps)
    return state


def call_transformer(model: nn.Module, cache: CacheState, step: int, slot: str, *args: Any, **kwargs: Any) -> Any:
    """One transformer forward of `cache`'s group at `step` (`slot`: which of the pipeline's transformers).

    A TeaCache step branches on its data and keeps residuals, so it calls the module (eager: never its CUDA
    graphs; compiled blocks still apply). A cache-dit group calls cache-dit's patched forward; a group that
    caches nothing takes exactly the uncached path: the compiled forward (`layers/compile.call_compiled`), or the
    class forward when cache-dit's hooks are on the module."""
    backend = cache.policy.backend
    if backend == "tea_cache":
        return model(*args, cache=cache.step(step, slot), **kwargs)
    if backend == "cache_dit":
        forwards = cache.backend_state.forwards
        forwards[slot] = forwards.get(slot, 0) + 1
        return model(*args, **kwargs)
    if slot not in cache.block_counts:
        cache.block_counts[slot] = num_blocks(model)
    cache.count(True, cache.block_counts[slot])
    if cachedit.is_enabled(model):
        return type(model).forward(model, *args, **kwargs)
    return call_compiled(model, *args, **kwargs)


def call_transformer_rows(model: nn.Module, states: list[DenoiseState], slot: str, *args: Any, **kwargs: Any) -> Any:
    """One forward of `model` over the rows of `states` at their own steps. One state: its cache decides the
    forward (`call_transformer`). Co-batched states cache nothing at this step (the executor only groups states
    whose `step_signature` is None), so each counts its blocks as computed and the forward is the plain one."""
    if len(states) == 1:
        return call_transformer(model, states[0].cache, states[0].step_index, slot, *args, **kwargs)
    if slot not in states[0].cache.block_counts:
        states[0].cache.block_counts[slot] = num_blocks(model)
    for state in states:
        state.cache.count(True, states[0].cache.block_counts[slot])
    if cachedit.is_enabled(model):
        return type(model).forward(model, *args, **kwargs)
    return call_compiled(model, *args, **kwargs)


def num_blocks(model: nn.Module) -> int:
    """The transformer's blocks (its `_repeated_blocks` classes), counted once per module instance."""
    names = set(getattr(model, "_repeated_blocks", ()))
    return sum(1 for module in model.modules() if type(module).__name__ in names)
