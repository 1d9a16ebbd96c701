"""What runs a stage: the one vocabulary for stage kinds, from YAML to the HTTP layer.

Code compares `StageKind` members, never strings; this module (with the config parser) is the only place a
kind's name is spelled. AR stages have always been shown to users as "llm" (`AsyncOmni.stage_types`,
`stage_durations` keys, stage names): `stage_type` keeps that name, and parsing accepts it.
"""

from __future__ import annotations

import enum


class StageKind(enum.StrEnum):
    AR = "ar"
    """Autoregressive: vLLM EngineCore (scheduler, KV cache, continuous batching)."""
    GENERATION = "generation"
    """Non-autoregressive model run on batched chunks (e.g. a vocoder)."""
    DIFFUSION = "diffusion"
    """Diffusion pipeline on the diffusion runtime (text encoder -> DiT -> VAE in one stage)."""

    @classmethod
    def _missing_(cls, value: object) -> StageKind | None:
        return cls.AR if value == _AR_DISPLAY_NAME else None

    @property
    def stage_type(self) -> str:
        """The user-visible name (`AsyncOmni.stage_types`, `stage_durations` keys): "llm" for AR."""
        return _AR_DISPLAY_NAME if self is StageKind.AR else self.value


_AR_DISPLAY_NAME = "llm"
