"""`/v1/videos` routes and the `/v1/realtime/video` WebSocket; handlers live on `app.state`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest
from vllm_omni.errors import OmniClientError

router = APIRouter()

_INT_FIELDS = {"num_inference_steps", "seed", "fps", "num_frames", "num_outputs_per_prompt", "short_edge",
               "frame_interpolation_exp"}
_FLOAT_FIELDS = {"seconds", "guidance_scale", "guidance_scale_2", "boundary_ratio", "flow_shift",
                 "start_time_seconds", "sound_duration", "frame_interpolation_scale"}
_BOOL_FIELDS = {"generate_sound", "enable_frame_interpolation"}


def _serving(request: Request | WebSocket) -> Any:
    serving = getattr(request.app.state, "serving_video", None)
    if serving is None:
        raise OmniClientError("this server's model does not generate video", status_code=404, param="model")
    return serving


def _coerce(key: str, value: str) -> object:
    """Multipart values arrive as strings; parse numbers and booleans so the model's checks apply."""
    try:
        if key in _INT_FIELDS:
            return int(value)
        if key in _FLOAT_FIELDS:
            return float(value)
    except ValueError as exc:
        raise OmniClientError(f"{key} must be a number, got {value!r}", param=key) from exc
    if key in _BOOL_FIELDS:
        if value.lower() not in ("true", "false", "1", "0"):
            raise OmniClientError(f"{key} must be true or false, got {value!r}", param=key)
        return value.lower() in ("true", "1")
    return value


async def _parse(raw: Request, serving: Any) -> tuple[VideoGenerationRequest, Any]:
    """JSON body, or multipart form with `input_reference` as an image file."""
    content_type = raw.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        try:
            body = await raw.json()
        except ValueError as exc:
            raise OmniClientError(f"request body is not valid JSON: {exc}") from exc
        return VideoGenerationRequest.model_validate(body), None
    limit = serving.limits.max_upload_bytes
    if int(raw.headers.get("content-length") or 0) > limit + 2**20:
        raise OmniClientError(f"request body is over the {limit} byte upload limit (see --max-upload-mb)",
                              status_code=413, param="input_reference")
    form = await raw.form(max_files=1, max_fields=64)
    fields: dict[str, object] = {}
    image = None
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key != "input_reference":
                raise OmniClientError(f"unexpected file field {key!r}; send the image as input_reference", param=key)
            image = serving.decode_upload(await value.read())
        else:
            fields[key] = _coerce(key, value)
    return VideoGenerationRequest.model_validate(fields), image


@router.post("/v1/videos")
async def create_video(raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    request, image = await _parse(raw_request, serving)
    return JSONResponse(serving.create_job(request, image).model_dump(mode="json"))


@router.post("/v1/videos/sync")
async def create_video_sync(raw_request: Request) -> Response:
    serving = _serving(raw_request)
    request, image = await _parse(raw_request, serving)
    return Response(await serving.create_sync(request, image), media_type="video/mp4")


@router.get("/v1/videos")
async def list_videos(raw_request: Request, order: str = "desc", after: str | None = None,
                      limit: int = Query(20)) -> JSONResponse:
    return JSONResponse(_serving(raw_request).list_videos(order, after, limit).model_dump(mode="json"))


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, raw_request: Request) -> JSONResponse:
    return JSONResponse(_serving(raw_request).retrieve(video_id).model_dump(mode="json"))


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, raw_request: Request, variant: str = "video", index: int = 0) -> Response:
    if variant != "video":
        raise OmniClientError(f"variant {variant!r} is not available; only 'video'", status_code=404,
                              param="variant")
    return Response(_serving(raw_request).content(video_id, index), media_type="video/mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, raw_request: Request) -> JSONResponse:
    return JSONResponse((await _serving(raw_request).delete(video_id)).model_dump(mode="json"))


@router.websocket("/v1/realtime/video")
async def realtime_video(websocket: WebSocket) -> None:
    handler = getattr(websocket.app.state, "serving_video_stream", None)
    if handler is None:
        await websocket.close(code=1008, reason="this server's model does not generate video")
        return
    await handler.handle(websocket)
