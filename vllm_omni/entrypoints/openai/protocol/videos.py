"""`/v1/videos` models: the OpenAI Videos API body plus the diffusion knobs video pipelines take."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from vllm_omni.entrypoints.openai.protocol.common import CheckedBody, diffusion_knob_fields

MAX_VIDEO_OUTPUTS = 10


class VideoGenerationStatus(StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


_VideoKnobs = create_model("VideoKnobs", __base__=CheckedBody,
                           **diffusion_knob_fields(exclude=("height", "width", "true_cfg_scale")))


class VideoGenerationRequest(_VideoKnobs):
    """OpenAI `videos.create` body (JSON or multipart) plus the schema's diffusion knobs (size replaces height /
    width). Omitted fields keep the server's defaults."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: float | None = Field(default=None, gt=0)
    """Clip length; with `fps` it sets `num_frames` (the pipeline rounds to what the VAE needs, e.g. 4k+1)."""
    size: str | None = None
    """"WIDTHxHEIGHT"."""
    input_reference: str | dict[str, Any] | None = None
    """JSON form: a `data:` URL or {"image_url": "data:..."}; multipart sends it as a file."""
    user: str | None = None
    """An end-user id for abuse tracking, as in OpenAI's API; logged with the job id, not used otherwise."""
    num_outputs_per_prompt: int = Field(default=1, ge=1, le=MAX_VIDEO_OUTPUTS)
    short_edge: int | None = Field(default=None, ge=1)
    start_time_seconds: float | None = Field(default=None, ge=0.0)
    generate_sound: bool = False
    """Refused when true: no served video pipeline makes audio."""
    sound_duration: float | None = Field(default=None, gt=0)
    """Refused when set (a knob of `generate_sound`)."""
    enable_frame_interpolation: bool | None = None
    """Refused when true: this server does not interpolate frames."""
    frame_interpolation_exp: int | None = Field(default=None, ge=1)
    """Refused when set (a knob of frame interpolation)."""
    frame_interpolation_scale: float | None = Field(default=None, gt=0)
    """Refused when set (a knob of frame interpolation)."""


class VideoError(BaseModel):
    code: str
    message: str


class VideoResponse(BaseModel):
    """The OpenAI `Video` object (+ `quality`, `stage_durations` and `cache`, vllm-omni extensions)."""

    id: str
    object: Literal["video"] = "video"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    progress: int = 0
    prompt: str | None = None
    remixed_from_video_id: str | None = None
    seconds: str
    size: str
    status: VideoGenerationStatus = VideoGenerationStatus.QUEUED
    error: VideoError | None = None
    quality: str = "default"
    stage_durations: dict[str, float] | None = None
    cache: dict[str, Any] | None = None
    """Once completed: what the diffusion cache ran (quality, backend, computed / reused block-steps)."""


class VideoListResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoResponse]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleteResponse(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


def video_response_from_request(model_name: str, req: VideoGenerationRequest, video_id: str, *, seconds: float,
                                size: str) -> VideoResponse:
    """The queued job object returned by `POST /v1/videos`."""
    return VideoResponse(id=video_id, model=model_name, prompt=req.prompt, seconds=f"{seconds:g}", size=size,
                         status=VideoGenerationStatus.QUEUED, quality=req.quality or "default")
