"""The cache-dit backend: cache-dit's DBCache (+ TaylorSeer) over our native transformers' blocks.

cache-dit is used through its public API only: `BlockAdapter` over the block lists, `enable_cache` once per
transformer, `refresh_context(transformer, cache_config=...)` before every request group (so each group runs
its own quality's `DBCacheConfig` from a fresh context) and `summary` for what was cached.

Our Qwen-Image and FLUX blocks take their step's adaLN table row as an argument (one GEMM per step computes
every block's modulation ahead), while cache-dit calls every block of a list with the same arguments; the
transformer therefore exposes `cache_dit_blocks`, thin wrappers that pick their own row (FLUX's single-stream
blocks also take the image / text streams separately, cache-dit's Pattern_0). Wan's blocks fit cache-dit as
they are (Pattern_2).

Why request mode only: cache-dit keeps a context (residual buffers, TaylorSeer state, counters) per cached
block list, on the transformer's context manager. Another request's forward in between (step mode) would read
and overwrite it, and a context cannot be saved and restored per request through the public API, so
`--cache-backend cache_dit --step-execution` is refused (use tea_cache, whose state is per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm_omni.diffusion.cache.policy import CachePolicy
from vllm_omni.diffusion.layers.compile import compiled_forward
from vllm_omni.inputs.cache_config import CACHE_DIT_KEYS


class IndexedBlock(nn.Module):
    """Block `index` of a list whose rows of the step's modulation table are passed to every block."""

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        self.block = block
        self.index = index

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, modulation: torch.Tensor,
                *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block(hidden_states, encoder_hidden_states, modulation[self.index], *args)


class JoinedBlock(nn.Module):
    """A single-stream block (on [text, image]) seen as a dual-stream one: image and text in, image and text out."""

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        self.block = block
        self.index = index

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, modulation: torch.Tensor,
                *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        text_len = encoder_hidden_states.shape[1]
        joined = self.block(torch.cat([encoder_hidden_states, hidden_states], dim=1), modulation[self.index], *args)
        return joined[:, text_len:], joined[:, :text_len]


def is_enabled(transformer: nn.Module) -> bool:
    return bool(getattr(transformer, "_is_cached", False))


def enable(transformer: nn.Module) -> None:
    """Install cache-dit's hooks on `transformer` once (its forward then runs the cached blocks)."""
    import cache_dit
    from cache_dit import BlockAdapter, DBCacheConfig, ForwardPattern

    if is_enabled(transformer):
        return
    # From now on the transformer runs cache-dit's forward or its class forward (`runtime.call_transformer`), never
    # a CUDA graph (one would have captured cache-dit's data-dependent branches; compiled blocks stay): free them.
    if (compiled := compiled_forward(transformer)) is not None:
        compiled.drop_cuda_graphs()
    lists = transformer.cache_dit_block_lists()
    for name, (blocks, _) in lists.items():
        if getattr(transformer, name, None) is not blocks:
            setattr(transformer, name, blocks)
    patterns = [ForwardPattern.Pattern_2 if pattern == 2 else ForwardPattern.Pattern_0 for _, pattern in lists.values()]
    adapter = BlockAdapter(transformer=transformer, blocks=[blocks for blocks, _ in lists.values()],
                           blocks_name=list(lists), forward_pattern=patterns, check_forward_pattern=False)
    cache_dit.enable_cache(adapter, cache_config=DBCacheConfig(enable_separate_cfg=False))


def db_cache_config(policy: CachePolicy, num_steps: int):
    """The request's `DBCacheConfig` (and TaylorSeer calibrator) from its policy's settings."""
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    settings = policy.config
    taylorseer = settings.pop("enable_taylorseer", False)
    order = settings.pop("taylorseer_order", 1)
    kwargs = {k: v for k, v in settings.items() if k in CACHE_DIT_KEYS or k.startswith("force_refresh")}
    config = DBCacheConfig(enable_separate_cfg=False, num_inference_steps=num_steps, **kwargs)
    return config, TaylorSeerCalibratorConfig(taylorseer_order=order) if taylorseer else None


def refresh(transformers: dict[str, nn.Module], policy: CachePolicy, num_steps: int) -> CacheDiTRun:
    """A fresh cache-dit context with this request group's config on each of its transformers."""
    import cache_dit

    for transformer in transformers.values():
        enable(transformer)
        config, calibrator = db_cache_config(policy, num_steps)
        cache_dit.refresh_context(transformer, cache_config=config, calibrator_config=calibrator, verbose=False)
    return CacheDiTRun(transformers, policy, num_steps)


@dataclass
class CacheDiTRun:
    """One request group's cache-dit run: its transformers (refreshed for it) and the forwards each took."""

    transformers: dict[str, nn.Module]
    policy: CachePolicy
    num_steps: int
    forwards: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Rows were dropped (an abort in a request-mode group): cache-dit's buffers hold them, start afresh."""
        refresh(self.transformers, self.policy, self.num_steps)

    def counts(self, policy: CachePolicy) -> tuple[int, int, int, int]:
        """(computed steps, reused steps, computed block-steps, reused block-steps), from cache-dit's stats."""
        import cache_dit

        out = [0, 0, 0, 0]
        for slot, steps in self.forwards.items():
            transformer = self.transformers[slot]
            stats = [s for s in cache_dit.summary(transformer, logging=False) if s.cache_options]
            lists = transformer.cache_dit_block_lists()
            total = sum(len(blocks) for blocks, _ in lists.values())
            kept = policy.get("Fn_compute_blocks", 8) + policy.get("Bn_compute_blocks", 0)
            reused_blocks = sum(len(s.cached_steps) * max(len(blocks) - kept, 0)
                                for s, (blocks, _) in zip(stats, lists.values(), strict=False))
            reused = len(stats[0].cached_steps) if stats else 0
            for i, value in enumerate((steps - reused, reused, steps * total - reused_blocks, reused_blocks)):
                out[i] += value
        return out[0], out[1], out[2], out[3]
