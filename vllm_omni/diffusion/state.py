"""The per-request denoise state a pipeline advances step by step (`DenoiseState`), kept apart from the
pipeline skeleton so the cache, previews and the step executor read it without importing the skeleton."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Self

import torch

from vllm_omni.diffusion.cache.state import CacheState
from vllm_omni.diffusion.request import OmniDiffusionRequest


@dataclass(frozen=True)
class CFG:
    """A group's classifier-free guidance: its scale, and which latent rows have an unconditional transformer row.

    The transformer rows of a guided step are the latent rows, then one unconditional row per latent row in
    `uncond` (all of them when None), in that order; the skeleton builds and combines them
    (`NativeDiffusionPipeline.cfg_step_inputs` / `guide`)."""

    scale: float
    uncond: torch.Tensor | None = None
    """Latent rows that have an unconditional row, in the order of those rows (e.g. FLUX's true CFG only for the
    requests with a negative prompt); None: every latent row."""

    def num_uncond(self, num_latent: int) -> int:
        return num_latent if self.uncond is None else len(self.uncond)

    def select(self, rows: torch.Tensor, num_latent: int) -> tuple[CFG | None, torch.Tensor]:
        """(the guidance of latent rows `rows` only, None when none of them keeps an unconditional row; the
        transformer rows they keep: `rows`, then their unconditional rows)."""
        if self.uncond is None:
            return self, torch.cat([rows, rows + num_latent])
        position = torch.full((num_latent,), -1, dtype=torch.long, device=rows.device)
        position[rows] = torch.arange(len(rows), device=rows.device)
        kept = (position[self.uncond] >= 0).nonzero().flatten()
        cfg = replace(self, uncond=position[self.uncond.index_select(0, kept)]) if len(kept) else None
        return cfg, torch.cat([rows, num_latent + kept])


class Conditioning(Protocol):
    """A family's per-group transformer inputs besides latents and timestep (text embeddings, ...); a family's
    conditioning dataclass subclasses it.

    Fields per prompt hold one row per transformer row: the latent rows' prompts, then (`cfg`) the unconditional
    rows' negative prompts."""

    cfg: CFG | None
    """The group's classifier-free guidance; None: one transformer row per latent row."""

    @property
    def do_cfg(self) -> bool:
        """Whether the group runs unconditional rows (at some steps)."""
        return self.cfg is not None

    def select(self, rows: torch.Tensor, text_rows: torch.Tensor) -> Self:
        """The conditioning of the latent rows `rows` only (indices into the current latent rows, in order);
        a field per prompt keeps `text_rows` (those rows, then their unconditional rows). The skeleton sets
        `cfg` of the result."""
        ...


@dataclass
class DenoiseState:
    """One group of co-batched requests from `prepare` to `finish`: everything a denoise step reads or advances.

    Latent rows are request-major: request `i` owns rows `i * outputs_per_request` up to the next request's.
    """

    requests: list[OmniDiffusionRequest]
    latents: torch.Tensor
    scheduler: Any
    """A fresh diffusers scheduler of this group only, its timesteps set."""
    conditioning: Conditioning
    outputs_per_request: int = 1
    durations: dict[str, float] = field(default_factory=dict)
    step_index: int = 0
    aborted: list[OmniDiffusionRequest] = field(default_factory=list)
    """Requests dropped by an abort; they leave with `RequestAbortedError`."""
    timesteps: torch.Tensor = field(init=False)
    normalized_timesteps: list[float] = field(init=False)
    """Host copy of the timesteps in [0, 1] (1.0 = pure noise), read once instead of syncing every step."""
    cache: CacheState = field(default_factory=CacheState)
    """This group's cache policy, residuals and counters (docs/cache.md); the default caches nothing."""

    def __post_init__(self) -> None:
        self.timesteps = self.scheduler.timesteps
        num_train = self.scheduler.config.get("num_train_timesteps", 1000)
        self.normalized_timesteps = [t / num_train for t in self.timesteps.tolist()]

    @property
    def done(self) -> bool:
        return not self.requests or self.step_index >= len(self.timesteps)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    def drop(self, request_ids: set[str]) -> None:
        """Remove the requests `request_ids`, their latent and conditioning rows; the other rows are unchanged."""
        keep = [i for i, r in enumerate(self.requests) if r.request_id not in request_ids]
        if len(keep) == len(self.requests):
            return
        self.aborted += [r for r in self.requests if r.request_id in request_ids]
        self.requests = [self.requests[i] for i in keep]
        self.cache.invalidate()  # its residuals hold the dropped rows too: the next step computes
        if not keep:
            self.latents = self.latents[:0]
            return
        per = self.outputs_per_request
        rows = torch.tensor([i * per + j for i in keep for j in range(per)], device=self.latents.device)
        self.conditioning = select_conditioning(self.conditioning, rows, self.latents.shape[0])
        self.latents = self.latents.index_select(0, rows)
        _select_scheduler_rows(self.scheduler, rows)


def select_conditioning(conditioning: Conditioning, rows: torch.Tensor, num_latent: int) -> Conditioning:
    """The conditioning of latent rows `rows` (of `num_latent`) only, with their unconditional rows and guidance."""
    cfg, text_rows = (None, rows) if conditioning.cfg is None else conditioning.cfg.select(rows, num_latent)
    selected = conditioning.select(rows, text_rows)
    selected.cfg = cfg
    return selected


_SCHEDULER_ROW_STATE = ("model_outputs", "last_sample")
"""Per-row history that diffusers' multistep schedulers (UniPC for Wan, DPM-Solver) keep between steps."""


def _select_scheduler_rows(scheduler: Any, rows: torch.Tensor) -> None:
    """Keep only latent rows `rows` in the scheduler's per-row history (stateless schedulers have none)."""
    for name in _SCHEDULER_ROW_STATE:
        value = getattr(scheduler, name, None)
        if isinstance(value, torch.Tensor):
            setattr(scheduler, name, value.index_select(0, rows))
        elif isinstance(value, list):
            setattr(scheduler, name, [v.index_select(0, rows) if isinstance(v, torch.Tensor) else v for v in value])
