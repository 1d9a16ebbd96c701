"""Build and run the vllm-omni OpenAI-compatible server on an `AsyncOmni` engine.

vLLM's pieces are reused where they fit (socket setup, uvicorn runner, CORS / API-key / request-id
middleware, protocol models). A pipeline that starts with an AR stage also gets vLLM's own OpenAI app on that
stage (its routers and serving classes: /v1/completions, /v1/responses, /tokenize, /detokenize, /version,
/ping, ...) through `OmniStageEngineClient`; our routes come first, so only those that need omni behaviour
(chat with audio/image outputs, images, speech, videos, /v1/models, /health, /metrics) are ours.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from fastapi import Depends, FastAPI, Request
from vllm import envs
from vllm.entrypoints.launchers.launcher import create_server_socket, serve_http
from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_omni.diffusion.core.prestart import PrestartedCore
from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.openai.api_router import add_unavailable_routes, router
from vllm_omni.entrypoints.openai.batch_serving import OmniOpenAIServingChatBatch
from vllm_omni.entrypoints.openai.engine_client import OmniStageEngineClient
from vllm_omni.entrypoints.openai.errors import register_exception_handlers
from vllm_omni.entrypoints.openai.lora import ServedLoRAs
from vllm_omni.entrypoints.openai.lora import router as lora_router
from vllm_omni.entrypoints.openai.metrics import OmniMetrics
from vllm_omni.entrypoints.openai.middleware import add_omni_middleware
from vllm_omni.entrypoints.openai.playground import router as playground_router
from vllm_omni.entrypoints.openai.serving_base import ServerLimits
from vllm_omni.entrypoints.openai.serving_chat import OmniOpenAIServingChat
from vllm_omni.entrypoints.openai.serving_images import OmniOpenAIServingImages
from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech
from vllm_omni.entrypoints.openai.serving_video import OmniOpenAIServingVideo
from vllm_omni.entrypoints.openai.serving_video_stream import OmniStreamingVideoOutputHandler
from vllm_omni.entrypoints.openai.video_api_router import router as video_router
from vllm_omni.entrypoints.openai.vllm_route_guards import register_guarded_vllm_routers
from vllm_omni.inputs.data import DiffusionLimits
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def served_model_name(args: argparse.Namespace) -> str:
    names = getattr(args, "served_model_name", None)
    if isinstance(names, list | tuple) and names:
        return names[0]
    return names or args.model


def load_chat_template(path_or_text: str | None) -> str | None:
    if path_or_text is None:
        return None
    from pathlib import Path

    path = Path(path_or_text)
    return path.read_text() if path.is_file() else path_or_text


VLLM_ROUTES = ("/v1/completions", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize")
"""vLLM routes that only an AR-first pipeline can serve; elsewhere they answer 404 saying why."""


def vllm_engine_client(engine: Any) -> OmniStageEngineClient | None:
    """vLLM's EngineClient on stage 0 when that stage is an AR stage on vLLM's AsyncLLM, else None (also for a
    text-to-speech talker: its prompts are placeholder ids its input processor makes, not text)."""
    capabilities = getattr(engine, "capabilities", None)
    stage_clients = getattr(getattr(engine, "engine", None), "stage_clients", None) or []
    if (capabilities is None or not capabilities.starts_with_ar or capabilities.speaks_input
            or not hasattr(stage_clients[0], "llm")):
        return None
    return OmniStageEngineClient(engine, stage_id=0)


def build_app(args: argparse.Namespace, engine: Any, supported_tasks: tuple[str, ...] | None = None) -> FastAPI:
    """The FastAPI app for `engine`; every handler finds what it needs on `app.state`. With `supported_tasks`
    (an AR-first pipeline, see `build_app_async`) vLLM's routers follow ours."""
    if args.disable_fastapi_docs:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    else:
        app = FastAPI(title="vllm-omni")
    app.root_path = args.root_path
    app.state.args = args
    app.include_router(router)
    app.include_router(video_router)
    if supported_tasks is not None:
        register_guarded_vllm_routers(args, app, supported_tasks, first=Depends(live_vllm_state))
        add_unavailable_routes(app, VLLM_ROUTES, f"`{served_model_name(args)}` does not serve {{path}} (the tasks "
                               f"served for it through vLLM: {list(supported_tasks)})")
    else:
        from vllm.entrypoints.serve.instrumentator.basic import router as vllm_basic_router

        app.include_router(vllm_basic_router)  # /version, /load
        if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:  # as vLLM: runtime adapter updates are opt-in
            app.include_router(lora_router)
        add_unavailable_routes(app, VLLM_ROUTES, f"{{path}} needs a pipeline whose first stage is a text (AR) "
                               f"model; `{served_model_name(args)}` starts with a "
                               f"{_first_stage_type(engine)} stage")
    if not args.disable_playground:
        app.include_router(playground_router)
    register_exception_handlers(app)
    init_entrypoints_middleware(args, app, supported_tasks=supported_tasks or ())
    add_omni_middleware(app, args)
    init_app_state(app, args, engine)
    app.state.metrics.install(app)
    return app


def _first_stage_type(engine: Any) -> str:
    types = list(getattr(engine, "stage_types", None) or ["non-text"])
    return types[0]


async def build_app_async(args: argparse.Namespace, engine: Any) -> FastAPI:
    """`build_app`, plus vLLM's OpenAI app state on stage 0 for an AR-first pipeline."""
    client = vllm_engine_client(engine)
    if client is None:
        app = build_app(args, engine)
        for module in getattr(args, "lora_modules", None) or []:  # the workers check each file first
            await app.state.loras.load(module.name, module.path)
        return app
    supported_tasks = tuple(await client.get_supported_tasks())
    app = build_app(args, engine, supported_tasks)
    app.state.vllm_supported_tasks = supported_tasks
    app.state.vllm_state_lock = asyncio.Lock()
    await init_vllm_state(client, app.state, args)
    return app


async def init_vllm_state(client: OmniStageEngineClient, state: Any, args: argparse.Namespace) -> None:
    """vLLM's OpenAI app state (its serving objects) made on the AR stage's AsyncLLM that serves now."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state as init_vllm_app_state

    build = client.llm_build
    await init_vllm_app_state(client, state, args, state.vllm_supported_tasks)
    state.log_stats = False  # each AR stage logs its own stats (vllm_omni/engine/stage_metrics.py)
    state.vllm_state_build = build


async def live_vllm_state(request: Request) -> None:
    """First dependency of vLLM's routes: vLLM's serving objects keep the renderer and input processor of the
    AsyncLLM they were made on, whose tokenizer pool a restart of the AR stage shut down; after one they are
    made again on the new AsyncLLM (vLLM's own `init_app_state`), and while it is being made the route is a 503."""
    state = request.app.state
    client = state.engine_client
    if client.llm_build == state.vllm_state_build:
        return
    async with state.vllm_state_lock:
        if client.llm_build != state.vllm_state_build:
            logger.info("AR stage %d has a new AsyncLLM: vLLM's serving objects are made again on it",
                        client.stage_id)
            await init_vllm_state(client, state, request.app.state.args)


def init_app_state(app: FastAPI, args: argparse.Namespace, engine: Any) -> None:
    model_name = served_model_name(args)
    state = app.state
    state.args = args
    state.engine = engine
    state.engine_client = None  # vLLM's EngineClient, set by vLLM's init_app_state for AR-first pipelines
    state.enable_server_load_tracking = False
    state.server_load_metrics = 0
    state.model_name = model_name
    state.model_path = args.model
    state.metrics = OmniMetrics(model_name)
    state.metrics.add_stage_registries(getattr(getattr(engine, "engine", None), "stage_metrics_registries", list))
    limits = ServerLimits(max_upload_bytes=int(args.max_upload_mb * 2**20),
                          max_request_outputs=args.max_request_outputs,
                          max_input_image_pixels=args.max_input_image_pixels,
                          max_input_audio_seconds=args.max_input_audio_seconds,
                          max_input_video_frames=args.max_input_video_frames,
                          diffusion=DiffusionLimits(max_inference_steps=args.max_inference_steps,
                                                    max_num_frames=args.max_num_frames,
                                                    max_output_pixels=args.max_output_pixels))
    state.loras = ServedLoRAs.from_args(args, engine)
    common = dict(engine=engine, model_name=model_name, metrics=state.metrics, limits=limits, loras=state.loras)
    if getattr(args, "reasoning_parser", None):
        raise ValueError("--reasoning-parser is not supported with --omni yet")
    chat = dict(chat_template=load_chat_template(getattr(args, "chat_template", None)),
                tool_parser=getattr(args, "tool_call_parser", None),
                enable_auto_tools=bool(getattr(args, "enable_auto_tool_choice", False)),
                trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)))
    state.serving_chat = OmniOpenAIServingChat(**common, **chat)
    state.serving_chat_batch = OmniOpenAIServingChatBatch(**common, **chat)
    state.serving_images = OmniOpenAIServingImages(**common)
    state.serving_speech = OmniOpenAIServingSpeech(**common)
    state.serving_video = OmniOpenAIServingVideo(**common)
    state.serving_video_stream = OmniStreamingVideoOutputHandler(state.serving_video)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Only the engine flags the user set (compared with the parser's defaults) travel to `AsyncOmni`."""
    from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser

    defaults = make_omni_arg_parser(FlexibleArgumentParser()).parse_args([])
    return OmniEngineArgs.omni_kwargs_from_cli(args, defaults)


_GRACEFUL_SHUTDOWN_S = 3.0


def build_engine(args: argparse.Namespace, prestarted_core: PrestartedCore | None = None) -> Any:
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    kwargs = engine_kwargs_from_args(args)
    logger.info("Starting AsyncOmni for %s with %s", args.model, kwargs)
    return AsyncOmni(args.model, prestarted_core=prestarted_core, **kwargs)


async def run_server(args: argparse.Namespace, *, prestarted_core: PrestartedCore | None = None,
                     **uvicorn_kwargs: Any) -> None:
    """Bind the socket first (so the port is ours), start the engine, then serve until SIGINT/SIGTERM.
    `prestarted_core`: the diffusion core process the CLI forked at its entry (`diffusion/core/prestart.py`).

    On SIGTERM, requests still running after `_GRACEFUL_SHUTDOWN_S` are cancelled (which aborts them in the
    engine) rather than awaited: a busy diffusion worker must not hold the server past 15 s."""
    uvicorn_kwargs.setdefault("timeout_graceful_shutdown", _GRACEFUL_SHUTDOWN_S)
    sock = create_server_socket((args.host or "", args.port), reuse_port=False)
    listen_address = f"http://{args.host or '0.0.0.0'}:{args.port}"
    engine = build_engine(args, prestarted_core)
    try:
        app = await build_app_async(args, engine)
        log_startup_summary(app, engine, listen_address)
        shutdown = await serve_http(
            app,
            sock=sock,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            **uvicorn_kwargs,
        )
        await shutdown
    finally:
        await engine.close_async()
        sock.close()


def log_startup_summary(app: FastAPI, engine: Any, listen_address: str) -> None:
    """One block at start-up: what is served, on which devices, where, and which routes."""
    for meta, config in zip(getattr(engine.engine, "stage_metadata", []), getattr(engine.config, "stages", []),
                            strict=False):
        logger.info("stage %s: %s (%s) on devices %s", meta["stage_id"], meta["stage_type"], config.name,
                    config.devices or "default")
    routes = sorted({path for route in app.routes if (path := getattr(route, "path", None))
                     and not path.startswith(("/docs", "/redoc", "/openapi"))})
    logger.info("vllm-omni server for %s (%s) listening on %s; routes: %s", app.state.model_path,
                ", ".join(engine.stage_types), listen_address, " ".join(routes))
