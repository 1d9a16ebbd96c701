"""`/v1/videos` (OpenAI Videos API: async jobs + a sync MP4 route) on video diffusion pipelines.

A job runs as an asyncio task on the server's loop: the engine generates frames (its `progress` follows the
denoise steps of pipelines that report them), then MP4 encoding runs in a
worker thread (`asyncio.to_thread`), so neither the engine nor the event loop waits on the encoder. Jobs live
in memory (bounded: the oldest finished jobs are dropped first).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.utils import random_uuid

from vllm_omni import envs
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.diffusion.video_utils import encode_mp4
from vllm_omni.entrypoints.openai.media import decode_image_async, decode_image_url
from vllm_omni.entrypoints.openai.protocol.common import parse_size
from vllm_omni.entrypoints.openai.protocol.videos import (
    VideoDeleteResponse,
    VideoError,
    VideoGenerationRequest,
    VideoGenerationStatus,
    VideoListResponse,
    VideoResponse,
    video_response_from_request,
)
from vllm_omni.entrypoints.openai.serving_base import OmniServingBase
from vllm_omni.errors import OmniClientError, OmniError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams, knob_names
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

DEFAULT_FPS = 16
DEFAULT_NUM_FRAMES = 81
DEFAULT_SIZE = (832, 480)
MAX_STORED_JOBS = 256
SYNC_TIMEOUT_S = envs.VLLM_OMNI_VIDEO_SYNC_TIMEOUT
"""Seconds `POST /v1/videos/sync` waits for the engine before giving up (and aborting the request)."""

_PARAM_FIELDS = tuple(name for name in knob_names(http=True) if name in VideoGenerationRequest.model_fields)
"""The schema's knobs the videos API takes; each one the client set overrides the server default."""


@dataclass
class GeneratedVideo:
    frames: np.ndarray
    """uint8 (T, H, W, 3)."""
    fps: int
    audio: np.ndarray | None = None
    """The clip's soundtrack (float (channels, samples)) for models that make one (LTX-2), muxed into the MP4."""
    sample_rate: int | None = None

    def encode(self) -> bytes:
        return encode_mp4(self.frames, self.fps, audio=self.audio, sample_rate=self.sample_rate)


@dataclass
class _VideoJob:
    response: VideoResponse
    task: asyncio.Task | None = None
    mp4: list[bytes] = field(default_factory=list)


class OmniOpenAIServingVideo(OmniServingBase):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._jobs: OrderedDict[str, _VideoJob] = OrderedDict()

    # ---- request -> engine input ---------------------------------------------------------------------------

    async def build_inputs(self, request: VideoGenerationRequest, upload: bytes | None
                           ) -> tuple[dict, list[Any]]:
        """(prompt, per-stage sampling params): server defaults, overridden by every field the client set. All
        checks run before the input image (`upload` bytes or `input_reference`) is decoded, off the loop."""
        self.check_model(request.model)
        self.require_output("video", "the videos API")
        self._reject_unsupported(request)
        params = []
        for stage_id, kind in enumerate(self.capabilities.stage_kinds):
            default = self.default_params(stage_id)
            params.append(self.video_params(default, request, stage_id) if kind is StageKind.DIFFUSION else default)
        prompt: dict[str, Any] = {"prompt": request.prompt}
        if upload is not None or request.input_reference is not None:
            self.check_accepts_images("input_reference")
            image = await (decode_image_async(upload, "input_reference", self.limits.max_input_image_pixels)
                           if upload is not None else self.decode_reference(request.input_reference))
            prompt["multi_modal_data"] = {"image": image}
        return prompt, params

    def video_params(self, default: Any, request: VideoGenerationRequest, stage_id: int
                     ) -> OmniDiffusionSamplingParams:
        base = default if isinstance(default, OmniDiffusionSamplingParams) else OmniDiffusionSamplingParams()
        updates = {name: getattr(request, name) for name in _PARAM_FIELDS if name in request.model_fields_set}
        width, height = parse_size(request.size)
        if width is not None:
            updates.update(width=width, height=height)
        if request.seconds is not None and "num_frames" in updates:
            raise OmniClientError("give seconds or num_frames, not both", param="seconds")
        if request.seconds is not None:
            fps = updates.get("fps") or base.fps or DEFAULT_FPS
            max_frames = self.limits.diffusion.max_num_frames
            if request.seconds * fps + 1 > max_frames:
                raise OmniClientError(f"seconds={request.seconds:g} at {fps} fps is more than the {max_frames} "
                                      "frames this server allows (see --max-num-frames)", param="seconds")
            updates.update(fps=fps, num_frames=int(round(request.seconds * fps)) + 1)
        sp = dataclasses.replace(base.clone(), **updates)
        self.check_diffusion_limits(sp, stage_id, size_field="size" if request.size else None)
        return sp

    @staticmethod
    def _reject_unsupported(request: VideoGenerationRequest) -> None:
        if request.generate_sound:
            raise OmniClientError("generate_sound is not supported by this model", param="generate_sound")
        if request.enable_frame_interpolation:
            raise OmniClientError("frame interpolation is not supported by this server",
                                  param="enable_frame_interpolation")
        # The knobs of those features: accepted alone they would be validated and never read.
        for name, feature in (("sound_duration", "generate_sound"), ("frame_interpolation_exp", "frame interpolation"),
                              ("frame_interpolation_scale", "frame interpolation")):
            if getattr(request, name) is not None:
                raise OmniClientError(f"{name} configures {feature}, which this server does not support",
                                      param=name)
        for name in ("short_edge", "start_time_seconds"):
            if getattr(request, name) is not None:
                raise OmniClientError(f"{name} applies to reference videos, which this model does not take",
                                      param=name)

    async def decode_reference(self, ref: Any) -> Any:
        if isinstance(ref, dict):
            if "image_url" not in ref:
                raise OmniClientError("input_reference must carry image_url (a data: URL)", param="input_reference")
            ref = ref["image_url"]
        if not isinstance(ref, str):
            raise OmniClientError("input_reference must be a data: URL string", param="input_reference")
        return await decode_image_url(ref, "input_reference", self.limits.max_upload_bytes,
                                      self.limits.max_input_image_pixels)

    def check_upload_size(self, data: bytes) -> None:
        if len(data) > self.limits.max_upload_bytes:
            raise OmniClientError(f"input_reference is over the {self.limits.max_upload_bytes} byte upload limit",
                                  status_code=413, param="input_reference")

    @staticmethod
    def describe(params: list[Any]) -> tuple[float, str]:
        """(seconds, "WxH") of the clip the diffusion stage will make, for the job object."""
        sp = next((p for p in params if isinstance(p, OmniDiffusionSamplingParams)), OmniDiffusionSamplingParams())
        fps = sp.fps or DEFAULT_FPS
        width, height = (sp.width, sp.height) if sp.width and sp.height else DEFAULT_SIZE
        return ((sp.num_frames or DEFAULT_NUM_FRAMES) - 1) / fps, f"{width}x{height}"

    # ---- generation ----------------------------------------------------------------------------------------

    async def generate_videos(self, prompt: dict, request_id: str, params: list[Any],
                              on_progress: Callable[[int, int], None] | None = None
                              ) -> tuple[list[GeneratedVideo], dict[str, float], dict[str, Any] | None]:
        """The request's videos, stage durations and cache summary; `on_progress(step, total)` follows the denoise
        loop of pipelines that report it."""
        if on_progress is None:
            finals = await self.generate_final(prompt, request_id, params)
        else:
            finals = await self._generate_with_progress(prompt, request_id, params, on_progress)
        videos: list[GeneratedVideo] = []
        durations: dict[str, float] = {}
        for out in finals:
            durations.update(out.stage_durations)
            mm = out.multimodal_output or {}
            if "video" not in mm:
                continue
            frames = np.asarray(mm["video"])
            fps = int(mm.get("fps") or DEFAULT_FPS)
            clips = frames if frames.ndim == 5 else frames[None]
            audio = mm.get("audio")
            tracks = [None] * len(clips) if audio is None else list(audio) if frames.ndim == 5 else [audio]
            videos.extend(GeneratedVideo(clip, fps, track, mm.get("sample_rate"))
                          for clip, track in zip(clips, tracks, strict=True))
        if not videos:
            raise OmniClientError(f"`{self.model_name}` returned no video for this request", status_code=422)
        return videos, durations, next((out.cache for out in finals if out.cache is not None), None)

    async def _generate_with_progress(self, prompt: dict, request_id: str, params: list[Any],
                                      on_progress: Callable[[int, int], None]) -> list[Any]:
        """The finals, the denoise progress on the way. Progress only: a job encodes one MP4 from the whole clip,
        so the stage sends it once in its final output rather than as chunks this process would have to join."""
        last: dict[int, Any] = {}
        async for out in self.generate(prompt, request_id, _with_progress(params)):
            mm = out.multimodal_output or {}
            if "progress" in mm:
                on_progress(mm["progress"]["step"], mm["progress"]["total"])
            elif "video_chunk" in mm:
                raise RuntimeError(f"stage {out.stage_id} streamed video chunks to a progress-only request")
            elif out.finished:
                last[out.stage_id] = out
        return [last[stage_id] for stage_id in sorted(last)]

    async def create_sync(self, request: VideoGenerationRequest, upload: bytes | None) -> bytes:
        """Generate and return the first video as MP4 bytes (the route answers with the body directly)."""
        prompt, params = await self.build_inputs(request, upload)
        request_id = f"video-{random_uuid()}"
        self.log_user(request_id, request.user)
        try:
            videos, _, _ = await asyncio.wait_for(self.generate_videos(prompt, request_id, params), SYNC_TIMEOUT_S)
        except TimeoutError as exc:
            raise OmniError(f"video generation took longer than {SYNC_TIMEOUT_S:g} s "
                            "(VLLM_OMNI_VIDEO_SYNC_TIMEOUT)", status_code=504) from exc
        return await asyncio.to_thread(videos[0].encode)

    # ---- async jobs ----------------------------------------------------------------------------------------

    async def create_job(self, request: VideoGenerationRequest, upload: bytes | None) -> VideoResponse:
        prompt, params = await self.build_inputs(request, upload)
        seconds, size = self.describe(params)
        video_id = f"video_{random_uuid()}"
        self.log_user(video_id, request.user)
        job = _VideoJob(video_response_from_request(self.model_name, request, video_id, seconds=seconds, size=size))
        self._jobs[video_id] = job
        self._evict()
        job.task = asyncio.create_task(self._run_job(job, prompt, params))
        return job.response.model_copy()

    async def _run_job(self, job: _VideoJob, prompt: dict, params: list[Any]) -> None:
        response = job.response
        response.status = VideoGenerationStatus.IN_PROGRESS
        try:
            videos, durations, cache = await self.generate_videos(prompt, response.id, params,
                                                           on_progress=functools.partial(_set_progress, job))
            job.mp4 = [await asyncio.to_thread(v.encode) for v in videos]
            response.stage_durations, response.cache = durations, cache
            response.progress = 100
            response.status = VideoGenerationStatus.COMPLETED
        except asyncio.CancelledError:
            response.status = VideoGenerationStatus.FAILED
            response.error = VideoError(code="cancelled", message="the video job was deleted")
            raise
        except Exception as exc:
            logger.info("video job %s failed: %s", response.id, exc)
            code = "invalid_request" if isinstance(exc, OmniClientError) else "generation_failed"
            response.status = VideoGenerationStatus.FAILED
            response.error = VideoError(code=code, message=str(exc) or type(exc).__name__)
        finally:
            response.completed_at = int(time.time())

    def _evict(self) -> None:
        done = [vid for vid, job in self._jobs.items() if job.task is None or job.task.done()]
        for vid in done[: max(0, len(self._jobs) - MAX_STORED_JOBS)]:
            del self._jobs[vid]

    def _job(self, video_id: str) -> _VideoJob:
        job = self._jobs.get(video_id)
        if job is None:
            raise OmniClientError(f"video {video_id!r} not found", status_code=404, param="video_id")
        return job

    def retrieve(self, video_id: str) -> VideoResponse:
        return self._job(video_id).response.model_copy()

    def content(self, video_id: str, index: int = 0) -> bytes:
        job = self._job(video_id)
        if job.response.status != VideoGenerationStatus.COMPLETED:
            raise OmniClientError(f"video {video_id!r} is not ready (status {job.response.status.value})",
                                  status_code=409, param="video_id")
        if not 0 <= index < len(job.mp4):
            raise OmniClientError(f"index must be in [0, {len(job.mp4)})", param="index")
        return job.mp4[index]

    def list_videos(self, order: str = "desc", after: str | None = None, limit: int = 20) -> VideoListResponse:
        if order not in ("asc", "desc"):
            raise OmniClientError(f"order must be asc or desc, got {order!r}", param="order")
        if not 1 <= limit <= 100:
            raise OmniClientError(f"limit must be in [1, 100], got {limit}", param="limit")
        ids = list(self._jobs) if order == "asc" else list(reversed(self._jobs))
        if after is not None:
            if after not in self._jobs:
                raise OmniClientError(f"after: video {after!r} not found", status_code=404, param="after")
            ids = ids[ids.index(after) + 1:]
        page = [self._jobs[vid].response.model_copy() for vid in ids[:limit]]
        return VideoListResponse(data=page, first_id=page[0].id if page else None,
                                 last_id=page[-1].id if page else None, has_more=len(ids) > limit)

    async def delete(self, video_id: str) -> VideoDeleteResponse:
        job = self._job(video_id)
        del self._jobs[video_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()  # `generate` aborts the request in the engine on its way out
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(job.task, 30.0)
        return VideoDeleteResponse(id=video_id)


def _with_progress(params: list[Any]) -> list[Any]:
    return [dataclasses.replace(p, stream_partial_outputs=True, stream_video_chunks=False)
            if isinstance(p, OmniDiffusionSamplingParams) else p for p in params]


def _set_progress(job: _VideoJob, step: int, total: int) -> None:
    """Denoising is most of a job: it maps to 0-95 %; decoding and encoding fill the rest (100 at the end)."""
    job.response.progress = max(job.response.progress or 0, min(95, int(95 * step / max(total, 1))))
