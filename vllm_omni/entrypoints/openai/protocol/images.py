"""`/v1/images/generations` and `/v1/images/edits` models (OpenAI Images API + diffusion fields)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_omni.entrypoints.openai.protocol.common import DiffusionFields


class ImageGenerationRequest(DiffusionFields):
    """OpenAI `images.generate` body. `n` maps to `num_outputs_per_prompt`."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1)
    response_format: Literal["b64_json", "url"] = "b64_json"
    """`url` returns a `data:` URL (the server keeps no files)."""
    output_format: Literal["png", "jpeg", "webp"] = "png"
    user: str | None = None
    stream: bool = False
    """Server-sent events: `image_generation.partial_image` previews, then `image_generation.completed`
    (generations only, n=1)."""
    partial_images: int | None = Field(default=None, ge=0, le=3)
    """Previews decoded at evenly spaced denoise steps before the final image (stream=true only); fewer come
    when the request has too few steps."""
    # Accepted for OpenAI compatibility; diffusion pipelines have no equivalent knob.
    style: str | None = None
    background: str | None = None
    moderation: str | None = None


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
