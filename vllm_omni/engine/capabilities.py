"""What a served model can do, decided once at start-up from the family specs and the stage graph.

The HTTP layer asks these questions ("does it take input images?", "does it speak?") instead of inspecting
stage kinds, so a new topology changes what routes accept by declaring modalities, not by editing routes.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.catalog.spec import Modality
from vllm_omni.config.stage_kind import StageKind


@dataclass(frozen=True)
class ModelCapabilities:
    stage_kinds: tuple[StageKind, ...]
    """For the few per-stage decisions left in the HTTP layer (which stage gets which sampling params)."""
    input_modalities: frozenset[Modality]
    """What a request may carry: the union over the stages the user's prompt feeds (no upstream `inputs`)."""
    output_modalities: frozenset[Modality]
    """What the final stages produce."""
    shape_rules: tuple[ShapeRule | None, ...] = ()
    """Per stage (by stage id): the output sizes a diffusion stage makes, checked on every route that takes a
    size before anything is queued; None (or missing) for stages without one."""

    def __post_init__(self) -> None:
        if not self.stage_kinds:
            raise ValueError("a model has at least one stage")

    @property
    def accepts_image_input(self) -> bool:
        return "image" in self.input_modalities

    @property
    def supports_edits(self) -> bool:
        """Image in, image out (`/v1/images/edits`)."""
        return self.accepts_image_input and "image" in self.output_modalities

    @property
    def starts_with_ar(self) -> bool:
        """The prompt goes to an AR (text) model first: chat templates, tools and n > 1 apply to it."""
        return self.stage_kinds[0] is StageKind.AR

    @property
    def speaks_input(self) -> bool:
        """Text-to-speech (audio out, no text out, e.g. Qwen3-TTS): `/v1/audio/speech` hands it the text as it
        is, where a model that also answers in text (Qwen3-Omni) speaks its answer to it."""
        return "audio" in self.output_modalities and "text" not in self.output_modalities

    def shape_rule(self, stage_id: int) -> ShapeRule | None:
        return self.shape_rules[stage_id] if stage_id < len(self.shape_rules) else None

    def describe(self) -> str:
        """For error messages: "takes [text], makes [image]"."""
        return f"takes {sorted(self.input_modalities)}, makes {sorted(self.output_modalities)}"
