"""Pieces every omni request model shares: strict unknown-field checks and diffusion extra-body fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_omni.errors import OmniClientError

ImageResponseFormat = Literal["b64_json", "url"]


def reject_unknown_fields(data: Any, *model_classes: type[BaseModel]) -> None:
    """OpenAI-style models accept extra keys silently; ours name the first key none of `model_classes` knows."""
    if not isinstance(data, dict):
        return
    known: set[str] = set()
    for model_cls in model_classes:
        for name, info in model_cls.model_fields.items():
            known.add(name)
            if info.alias:
                known.add(info.alias)
    unknown = sorted(set(data) - known)
    if unknown:
        raise OmniClientError(f"unknown field(s) in request body: {unknown}", param=unknown[0])


class DiffusionFields(BaseModel):
    """Diffusion knobs accepted as top-level (extra body) fields on chat and image routes.

    Values are checked again by `OmniDiffusionSamplingParams`, which names the field on error.
    """

    model_config = ConfigDict(extra="forbid")

    size: str | None = None
    """"WIDTHxHEIGHT" (e.g. "512x512") or "auto"."""
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    cfg_scale: float | None = None
    """Alias of `true_cfg_scale`."""
    negative_prompt: str | None = None
    seed: int | None = None
    quality: str | None = None
    num_outputs_per_prompt: int | None = Field(default=None, ge=1)
    num_frames: int | None = None
    fps: int | None = None

    @model_validator(mode="after")
    def _resolve_aliases(self) -> DiffusionFields:
        if self.cfg_scale is not None:
            if self.true_cfg_scale is not None and self.true_cfg_scale != self.cfg_scale:
                raise OmniClientError("give either cfg_scale or true_cfg_scale, not both", param="cfg_scale")
            self.true_cfg_scale = self.cfg_scale
            self.cfg_scale = None
        return self


DIFFUSION_FIELD_NAMES: frozenset[str] = frozenset(DiffusionFields.model_fields)


def parse_size(size: str | None, param: str = "size") -> tuple[int | None, int | None]:
    """"WxH" -> (width, height); None/"auto" -> (None, None)."""
    if size is None or size == "auto":
        return None, None
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise OmniClientError(f"{param} must look like '512x512' (WIDTHxHEIGHT) or 'auto', got {size!r}",
                              param=param)
    width, height = (int(p) for p in parts)
    if width <= 0 or height <= 0:
        raise OmniClientError(f"{param} must have positive width and height, got {size!r}", param=param)
    return width, height
