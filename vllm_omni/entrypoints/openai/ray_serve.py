"""The OpenAI server as a Ray Serve application: N replicas of one pipeline behind one endpoint.

Each replica is a Serve actor holding what `vllm serve MODEL --omni` holds (the engine and the FastAPI app,
built from the same flags by the same functions); Ray Serve does the rest: its proxy is the one endpoint and
routes each request to the replica with the shorter queue of two it samples, its autoscaler adds or removes
replicas on ongoing requests per replica, and its controller restarts a replica whose actor died or whose
health check (the engine is dead) failed; the proxy callback of `ray_serve_proxy` turns a request lost with its
replica into a 503. Started from a Serve config file (recipes/ray_serve_qwen_image.yaml):

    export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=vllm_omni.entrypoints.openai.ray_serve_proxy:proxy_middlewares
    serve run recipes/ray_serve_qwen_image.yaml      # or: serve deploy ... against a cluster started with it set
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from ray import serve
from ray.serve import Application
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser
from vllm_omni.entrypoints.openai.api_server import build_app_async, build_engine
from vllm_omni.entrypoints.openai.ray_serve_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from vllm_omni.errors import EngineDeadError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

REPLICA_HEADER = "x-omni-replica"


def parse_server_args(model: str, args: str = "") -> Any:
    """The namespace `vllm serve MODEL --omni ARGS` would have (host and port are the Serve proxy's)."""
    parsed = make_omni_arg_parser(FlexibleArgumentParser()).parse_args([model, *shlex.split(args)])
    parsed.model = parsed.model_tag
    return parsed


@serve.ingress()
class OmniServer:
    """One replica: an `AsyncOmni` engine and the OpenAI app on it."""

    def __init__(self, model: str, args: str = "") -> None:
        self.args = parse_server_args(model, args)
        self.engine = build_engine(self.args)

    async def __serve_build_asgi_app__(self) -> Any:
        app = await build_app_async(self.args, self.engine)
        replica = serve.get_replica_context().replica_id.unique_id

        @app.middleware("http")
        async def name_the_replica(request: Any, call_next: Any) -> Any:
            """Which replica answered (`x-omni-replica`): what an operator reads a replica's log or /metrics by."""
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response

        return app

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine is dead is replaced, not kept answering 503."""
        if self.engine.errored:
            raise EngineDeadError(f"the engine of {self.args.model} is dead")

    async def __del__(self) -> None:
        await self.engine.close_async()


def build_app(config: dict[str, Any]) -> Application:
    """The Serve config's `import_path` target; `args: {model: ..., args: "<vllm serve flags>"}`. Replicas,
    autoscaling and each replica's Ray resources come from the config's `deployments: [{name: OmniServer}]`."""
    unknown = sorted(set(config) - {"model", "args"})
    if "model" not in config or unknown:
        raise ValueError(f"the vllm-omni Serve application takes args {{model, args}}; got {sorted(config)}")
    if os.environ.get(PROXY_CALLBACK_ENV) != PROXY_CALLBACK:  # this node's env is what its Serve proxy got
        logger.warning(
            "%s=%s is not set on this Ray node: Serve's proxy answers a request whose replica died with a bare 500 "
            "instead of 503 (docs/scale_out.md#replicas)",
            PROXY_CALLBACK_ENV,
            PROXY_CALLBACK,
        )
    return serve.deployment(OmniServer).bind(config["model"], config.get("args", ""))
