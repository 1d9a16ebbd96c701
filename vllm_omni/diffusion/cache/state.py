"""Per-request cache state: what a request's cache keeps between its denoise steps, inside its `DenoiseState`.

Nothing lives on the transformer or in module globals, so requests with different policies can be resident in
one worker (step mode) and each gets what it gets alone. A transformer's block loop is wrapped by
`BlockCache.run` for the rows of one forward: the blocks either run (and their residual, output minus input,
is kept) or are skipped and the kept residual is added to this step's input (TeaCache).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.diffusion.cache.policy import LOSSLESS, CachePolicy


@dataclass
class _Slot:
    """What one transformer (one expert of Wan2.2) of one request carries from a step to the next."""

    residual: torch.Tensor | None = None
    previous_probe: torch.Tensor | None = None
    accumulated: float = 0.0
    reused_in_a_row: int = 0


@dataclass
class CacheState:
    """One request group's cache: its policy, its residuals / probes per transformer, and its counters."""

    policy: CachePolicy = LOSSLESS
    num_steps: int = 0
    coefficients: tuple[float, ...] = ()
    computed_steps: int = 0
    reused_steps: int = 0
    computed_block_steps: int = 0
    reused_block_steps: int = 0
    slots: dict[str, _Slot] = field(default_factory=dict)
    block_counts: dict[str, int] = field(default_factory=dict)
    """Blocks of each transformer slot, counted on its first uncached forward."""
    backend_state: Any = None
    """A backend's own per-request object (the cache-dit runtime's context), if it keeps one."""

    @classmethod
    def create(cls, policy: CachePolicy, num_steps: int, coefficients: tuple[float, ...] = ()) -> CacheState:
        """`coefficients`: the family's TeaCache polynomial (`FamilyPresets`), unless the policy sets its own."""
        custom = policy.get("coefficients")
        return cls(policy, num_steps, tuple(custom) if custom else coefficients)

    @property
    def teacache(self) -> bool:
        return self.policy.backend == "tea_cache"

    def step(self, step: int, slot: str = "transformer") -> BlockCache | None:
        """The handle a transformer forward of `step` takes; None = run the blocks plainly (nothing cached)."""
        if not self.teacache:
            return None
        return BlockCache(self, self.slots.setdefault(slot, _Slot()), step)

    def step_signature(self, step: int) -> Hashable:
        """Equal for two states iff their forwards at `step` do the same cache work: the co-batching key.

        None: nothing is cached (any such states may share a forward). A fixed schedule: (policy, compute?).
        Adaptive policies decide from their own data, so each state is its own key."""
        if not self.policy.active:
            return None
        if self.policy.adaptive:
            return ("adaptive", id(self))
        return (self.policy, self.scheduled(step))

    def scheduled(self, step: int) -> bool:
        """Whether the TeaCache schedule runs the blocks at `step` whatever the data: warmup, cooldown, a forced
        refresh, and (fixed schedules) every `interval`-th step after the warmup."""
        get = self.policy.get
        warmup, cooldown = get("warmup_steps", 1), get("cooldown_steps", 1)
        if step < warmup or step >= self.num_steps - cooldown or self._forced(step):
            return True
        return not self.policy.adaptive and (step - warmup) % get("interval", 1) == 0

    def _forced(self, step: int) -> bool:
        hint = self.policy.get("force_refresh_step_hint")
        if hint is None:
            return False
        return step == hint or (self.policy.get("force_refresh_step_policy", "once") == "repeat" and step % hint == 0)

    def invalidate(self) -> None:
        """Rows were dropped (an abort in a request-mode group): the next step of every slot computes."""
        self.slots.clear()
        if self.backend_state is not None:
            self.backend_state.reset()

    def count(self, computed: bool, num_blocks: int) -> None:
        if computed:
            self.computed_steps += 1
            self.computed_block_steps += num_blocks
        else:
            self.reused_steps += 1
            self.reused_block_steps += num_blocks

    def summary(self) -> dict[str, Any]:
        """What ran, for the request's output metadata."""
        if self.backend_state is not None:  # a backend that counts itself (cache-dit)
            (self.computed_steps, self.reused_steps, self.computed_block_steps,
             self.reused_block_steps) = self.backend_state.counts(self.policy)
        return {"quality": self.policy.quality, "backend": self.policy.backend, "custom": self.policy.custom,
                "config": self.policy.config, "computed_steps": self.computed_steps,
                "reused_steps": self.reused_steps, "computed_block_steps": self.computed_block_steps,
                "reused_block_steps": self.reused_block_steps}


@dataclass
class BlockCache:
    """One transformer forward's view of its request group's cache (TeaCache)."""

    state: CacheState
    slot: _Slot
    step: int

    def run(self, hidden: torch.Tensor, blocks: Callable[[], torch.Tensor], probe: Callable[[], torch.Tensor],
            num_blocks: int) -> torch.Tensor:
        """`blocks()` (the block loop over `hidden`), or `hidden` + the residual it left at the last computed
        step. `probe()` is the tensor whose change decides in adaptive mode (read only then)."""
        compute = self._decide(probe)
        self.state.count(compute, num_blocks)
        if not compute:
            self.slot.reused_in_a_row += 1
            return hidden + self.slot.residual
        out = blocks()
        self.slot.residual = out - hidden
        self.slot.reused_in_a_row = 0
        return out

    def _decide(self, probe: Callable[[], torch.Tensor]) -> bool:
        state, slot = self.state, self.slot
        if not state.policy.adaptive:
            return slot.residual is None or state.scheduled(self.step)
        current = probe().float()
        previous, slot.previous_probe = slot.previous_probe, current
        if slot.residual is None or previous is None or state.scheduled(self.step):
            slot.accumulated = 0.0
            return True
        change = ((current - previous).abs().mean() / previous.abs().mean().clamp_min(1e-12)).item()
        slot.accumulated += _polyval(state.coefficients, change)
        max_reused = state.policy.get("max_cached_steps")
        if slot.accumulated >= state.policy.get("rel_l1_thresh") or (
                max_reused is not None and slot.reused_in_a_row >= max_reused):
            slot.accumulated = 0.0
            return True
        return False


def _polyval(coefficients: tuple[float, ...], x: float) -> float:
    out = 0.0
    for c in coefficients:
        out = out * x + c
    return out
