"""`/v1/images/generations` and `/v1/images/edits` models (OpenAI Images API + diffusion fields)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vllm_omni.entrypoints.openai.protocol.common import DiffusionFields
from vllm_omni.errors import OmniClientError

OPENAI_IMAGE_QUALITY: dict[str, str | None] = {
    "auto": None, "standard": None, "medium": "high", "hd": "lossless", "low": "fast"}
"""OpenAI's image `quality` values -> our quality presets (None: the server's default). Our own preset names
(`lossless`, `high`, `fast`) are accepted as they are: OpenAI's `high` is our `high` preset."""


class ImageGenerationRequest(DiffusionFields):
    """OpenAI `images.generate` body. `n` maps to `num_outputs_per_prompt`."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int | None = Field(default=None, ge=1)
    """Images per prompt (default 1); `num_outputs_per_prompt` is the same knob under our name."""
    response_format: Literal["b64_json", "url"] = "b64_json"
    """`url` returns a `data:` URL (the server keeps no files)."""
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    """OpenAI's compression level in percent for jpeg / webp (encoder quality = 100 - compression); png is
    lossless and takes only 0 or none."""
    background: Literal["auto", "opaque"] | None = None
    """Our pipelines draw opaque images; `transparent` is refused."""
    moderation: Literal["low"] | None = None
    """No content moderation runs on this server: only `low` (the least filtering) is honest to accept."""
    user: str | None = None
    """An end-user id for abuse tracking, as in OpenAI's API; logged with the request id (INFO), not used otherwise."""
    stream: bool = False
    """Server-sent events: `image_generation.partial_image` previews, then `image_generation.completed`
    (generations only, n=1)."""
    partial_images: int | None = Field(default=None, ge=0, le=3)
    """Previews decoded at evenly spaced denoise steps before the final image (stream=true only); fewer come
    when the request has too few steps."""

    @field_validator("quality", mode="before")
    @classmethod
    def _map_openai_quality(cls, value: object) -> object:
        return OPENAI_IMAGE_QUALITY.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_compression(self) -> ImageGenerationRequest:
        if self.output_format == "png" and self.output_compression not in (None, 0):
            raise OmniClientError("output_compression applies to jpeg and webp; png is lossless (give 0 or leave "
                                  "it out)", param="output_compression")
        return self

    @property
    def num_images(self) -> int:
        """`n` or `num_outputs_per_prompt` (the same knob; both given must agree)."""
        if self.n is not None and self.num_outputs_per_prompt is not None and self.n != self.num_outputs_per_prompt:
            raise OmniClientError(f"n={self.n} and num_outputs_per_prompt={self.num_outputs_per_prompt} disagree; "
                                  "give one of them", param="num_outputs_per_prompt")
        return self.n or self.num_outputs_per_prompt or 1


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]
    output_format: str | None = None
    stage_durations: dict[str, float] | None = None
    """vllm-omni extension: seconds per stage/phase of the request."""
    cache: dict[str, Any] | None = None
    """vllm-omni extension: what the diffusion cache ran (quality, backend, computed / reused block-steps)."""


class ImageGenStreamEvent(BaseModel):
    """One SSE event of a streamed generation, as OpenAI's `ImageGenPartialImageEvent` /
    `ImageGenCompletedEvent`."""

    type: Literal["image_generation.partial_image", "image_generation.completed"]
    b64_json: str
    created_at: int
    output_format: str
    size: str
    """"WIDTHxHEIGHT" of this image."""
    background: str = "auto"
    quality: str = "auto"
    partial_image_index: int | None = None
    """Partial images only: 0-based."""
    usage: dict[str, Any] | None = None
    """Completed event only: token counts are a GPT image model notion; diffusion pipelines report zeros."""
