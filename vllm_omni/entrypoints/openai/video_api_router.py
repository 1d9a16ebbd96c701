"""`/v1/videos` routes and the `/v1/realtime/video` WebSocket; handlers live on `app.state`."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Query, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from vllm_omni.entrypoints.openai.api_router import check_ignored_fields
from vllm_omni.entrypoints.openai.protocol.common import coerce_form
from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest
from vllm_omni.errors import OmniClientError

router = APIRouter()

def _serving(request: Request | WebSocket) -> Any:
    serving = getattr(request.app.state, "serving_video", None)
    if serving is None:
        raise OmniClientError("this server's model does not generate video", status_code=404, param="model")
    return serving


async def _parse(raw: Request, serving: Any) -> tuple[VideoGenerationRequest, bytes | None]:
    """JSON body, or multipart form with `input_reference` as an image file (returned undecoded)."""
    content_type = raw.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise OmniClientError("send application/json or multipart/form-data (Content-Type is "
                                  f"{content_type[:64]!r})", status_code=415, param="content-type")
        try:
            body = json.loads(await raw.body())
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
            raise OmniClientError(f"request body is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}",
                                  param="body") from exc
        request = VideoGenerationRequest.model_validate(body)
        check_ignored_fields(raw, request)
        return request, None
    limit = serving.limits.max_upload_bytes
    if int(raw.headers.get("content-length") or 0) > limit + 2**20:
        raise OmniClientError(f"request body is over the {limit} byte upload limit (see --max-upload-mb)",
                              status_code=413, param="input_reference")
    form = await raw.form(max_files=1, max_fields=64)
    fields: dict[str, str] = {}
    upload = None
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key != "input_reference":
                raise OmniClientError(f"unexpected file field {key!r}; send the image as input_reference", param=key)
            upload = await value.read()
            serving.check_upload_size(upload)
        else:
            fields[key] = value
    request = VideoGenerationRequest.model_validate(coerce_form(fields, VideoGenerationRequest))
    check_ignored_fields(raw, request)
    return request, upload


@router.post("/v1/videos")
async def create_video(raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    request, upload = await _parse(raw_request, serving)
    return JSONResponse((await serving.create_job(request, upload)).model_dump(mode="json"))


@router.post("/v1/videos/sync")
async def create_video_sync(raw_request: Request) -> Response:
    serving = _serving(raw_request)
    request, upload = await _parse(raw_request, serving)
    return Response(await serving.create_sync(request, upload), media_type="video/mp4")


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
