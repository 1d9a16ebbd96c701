"""The omni HTTP routes. Each resolves its handler from `app.state`, so the app is built once per engine."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation

from vllm_omni.entrypoints.openai.errors import error_json
from vllm_omni.entrypoints.openai.protocol.audio import SpeechRequest
from vllm_omni.entrypoints.openai.protocol.chat import OmniBatchChatCompletionRequest, OmniChatCompletionRequest
from vllm_omni.entrypoints.openai.protocol.common import coerce_form
from vllm_omni.entrypoints.openai.protocol.images import ImageGenerationRequest
from vllm_omni.entrypoints.openai.protocol.omni import ControlResponse, SleepRequest, WakeupRequest
from vllm_omni.entrypoints.openai.serving_base import maybe_await
from vllm_omni.errors import OmniClientError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)
router = APIRouter()
HEALTH_TIMEOUT_S = 5.0
JsonBody = Depends(validate_json_request)
IMAGE_FILE_FIELDS = ("image", "image[]")


def _state(request: Request):
    return request.app.state


def check_ignored_fields(raw_request: Request, body: Any) -> None:
    """vLLM's field policy for the body's unknown fields: ignored with a warning (clients such as the OpenAI
    SDK send `store`, `metadata`, `service_tier`, ...), or a 400 naming them under --strict-request-fields."""
    ignored = body.ignored_fields
    if not ignored:
        return
    path = raw_request.url.path
    if getattr(_state(raw_request).args, "strict_request_fields", False):
        raise OmniClientError(f"unknown field(s) in request body: {ignored} (this server runs with "
                              "--strict-request-fields)", param=ignored[0])
    logger.warning("%s: ignoring unknown request field(s) %s (--strict-request-fields refuses them)", path,
                   ignored)


@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while the engine is alive, as vLLM answers; while it sleeps the body says so
    ({"status": "sleeping", "is_sleeping": true}) and generation requests get 503 until /v1/omni/wakeup; while
    a stage replica is dead or restarting and another serves, {"status": "degraded", "stages": [...]}."""
    engine = _state(raw_request).engine
    if getattr(engine, "is_dead", False):
        return error_json(str(getattr(engine, "dead_error", "engine is dead")), 503)
    try:
        await asyncio.wait_for(maybe_await(engine.check_health()), HEALTH_TIMEOUT_S)
    except Exception as exc:
        return error_json(f"engine is unhealthy: {type(exc).__name__}: {exc}", 503)
    if getattr(engine, "is_sleeping", False):
        return JSONResponse({"status": "sleeping", "is_sleeping": True})
    if degraded := getattr(engine, "degraded_stages", list)():
        return JSONResponse({"status": "degraded", "stages": degraded})
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(raw_request: Request) -> JSONResponse:
    """vLLM's route of the same name."""
    return JSONResponse({"is_sleeping": bool(getattr(_state(raw_request).engine, "is_sleeping", False))})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    state = _state(raw_request)
    if (stage_health := getattr(state.engine, "stage_health", None)) is not None:
        state.metrics.observe_replicas(stage_health())
    return state.metrics.render()


@router.get("/v1/models")
async def show_models(raw_request: Request) -> JSONResponse:
    state = _state(raw_request)
    vllm_models = getattr(state, "openai_serving_models", None)
    if vllm_models is not None:  # an AR-first pipeline: vLLM's card (max_model_len, LoRA modules)
        return JSONResponse((await vllm_models.show_available_models()).model_dump())
    card = ModelCard(id=state.model_name, root=state.model_path, owned_by="vllm-omni")
    adapters = [ModelCard(**entry) for entry in state.loras.model_cards(state.model_name)]
    return JSONResponse(ModelList(data=[card, *adapters]).model_dump())


@router.post("/v1/chat/completions", dependencies=[JsonBody])
@with_cancellation
async def create_chat_completion(request: OmniChatCompletionRequest, raw_request: Request):
    check_ignored_fields(raw_request, request)
    state = _state(raw_request)
    if getattr(state, "openai_serving_chat", None) is not None and state.serving_chat.wants_vllm_chat(request):
        from vllm.entrypoints.openai.chat_completion.api_router import create_chat_completion as vllm_chat

        return await vllm_chat(request, raw_request)
    return await state.serving_chat.create_chat_completion(request, raw_request)


@router.post("/v1/chat/completions/batch", dependencies=[JsonBody])
@with_cancellation
async def create_batch_chat_completion(request: OmniBatchChatCompletionRequest, raw_request: Request):
    check_ignored_fields(raw_request, request)
    return await _state(raw_request).serving_chat_batch.create_batch_chat_completion(request, raw_request)


@router.post("/v1/images/generations", dependencies=[JsonBody])
@with_cancellation
async def create_images(request: ImageGenerationRequest, raw_request: Request) -> Response:
    check_ignored_fields(raw_request, request)
    if request.stream:
        return await _state(raw_request).serving_images.stream_images(request)
    response = await _state(raw_request).serving_images.generate_images(request)
    return JSONResponse(response.model_dump(exclude_none=True))


@router.post("/v1/images/edits")
async def edit_images(raw_request: Request) -> JSONResponse:
    state = _state(raw_request)
    limit = state.serving_images.limits.max_upload_bytes
    if int(raw_request.headers.get("content-length") or 0) > limit + 2**20:
        raise OmniClientError(f"request body is over the {limit} byte upload limit (see --max-upload-mb)",
                              status_code=413, param="image")
    form = await raw_request.form(max_files=16, max_fields=64)
    uploads, fields = [], {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key not in IMAGE_FILE_FIELDS:
                raise OmniClientError(f"unexpected file field {key!r}; send images as 'image'", param=key)
            uploads.append((key, await value.read()))
        else:
            fields[key] = value
    request = ImageGenerationRequest.model_validate(coerce_form(fields, ImageGenerationRequest))
    check_ignored_fields(raw_request, request)
    response = await state.serving_images.edit_images(request, uploads)
    return JSONResponse(response.model_dump(exclude_none=True))


@router.post("/v1/audio/speech", dependencies=[JsonBody])
@with_cancellation
async def create_speech(request: SpeechRequest, raw_request: Request) -> Response:
    check_ignored_fields(raw_request, request)
    return await _state(raw_request).serving_speech.create_speech(request)


@router.post("/v1/omni/sleep", dependencies=[JsonBody])
async def sleep(raw_request: Request, request: SleepRequest | None = None) -> JSONResponse:
    engine = _state(raw_request).engine
    request = request or SleepRequest()
    acks = await maybe_await(engine.sleep(stage_ids=request.stage_ids, level=request.level))
    return JSONResponse(ControlResponse(acks=_acks(acks)).model_dump())


@router.post("/v1/omni/wakeup", dependencies=[JsonBody])
async def wakeup(raw_request: Request, request: WakeupRequest | None = None) -> JSONResponse:
    engine = _state(raw_request).engine
    request = request or WakeupRequest()
    acks = await maybe_await(engine.wake_up(stage_ids=request.stage_ids, tags=request.tags))
    if request.resume:
        await maybe_await(engine.resume_generation(stage_ids=request.stage_ids))
    return JSONResponse(ControlResponse(acks=_acks(acks)).model_dump())


def add_unavailable_routes(app: FastAPI, paths: tuple[str, ...], reason: str) -> None:
    """A 404 naming `reason` (formatted with the path) for each of `paths` the app does not serve."""
    served = {getattr(route, "path", None) for route in app.routes}

    def answer(path: str):
        async def unavailable() -> JSONResponse:
            return error_json(reason.format(path=path), 404)

        return unavailable

    for path in paths:
        if path not in served:
            app.add_api_route(path, answer(path), methods=["GET", "POST"], include_in_schema=False)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(raw_request: Request) -> Response:
    """vLLM's (SageMaker's) liveness route: the same answer as /health."""
    return await health(raw_request)


def _acks(acks: object) -> list[dict]:
    """Acks may be dataclasses or msgspec structs; both become plain JSON objects."""
    import msgspec

    items = acks if isinstance(acks, list | tuple) else [acks] if acks is not None else []
    out = []
    for ack in items:
        value = msgspec.to_builtins(ack, builtin_types=())
        out.append(value if isinstance(value, dict) else {"result": value})
    return out
