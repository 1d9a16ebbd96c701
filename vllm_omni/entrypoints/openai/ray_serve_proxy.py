"""Ray Serve's HTTP proxy answers 503 for a request whose replica died under it.

When a replica's actor dies mid-request, Serve's proxy gets `RayActorError` from the replica's handle, logs it and
ends the ASGI call without a response, which its HTTP server then answers with a bare 500. That request was lost
with its replica, not failed by the pipeline: the client should see a 503 with an OpenAI-style body and retry, as
every other replica still answers. A live replica always starts its own response (a pipeline error is its own
500, a dead engine its 503), and Serve's proxy starts its own for 404 / 408 / 429 / 503, so a call that ends with
no response started is one whose replica went away before answering (or whose client already left: it reads
nothing either way).

Serve loads proxy middlewares from the HTTP proxy callback named by an environment variable of the proxy's
node (Serve's documented hook; `HTTPOptions.middlewares` is deprecated), so each node of a Serve cluster starts
with it set (docs/scale_out.md#replicas):

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=vllm_omni.entrypoints.openai.ray_serve_proxy:proxy_middlewares \\
        ray start --head

This module stays light (no vLLM import): every proxy imports it at start-up.
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = f"{__name__}:proxy_middlewares"

_LOST = json.dumps(
    {
        "error": {
            "message": "the replica serving this request died before answering; Ray Serve is replacing it and the "
            "other replicas are serving: retry the request",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
).encode()


class LostReplicaMiddleware:
    """An HTTP call Serve's proxy ended without starting a response (its replica died) is answered 503."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, receive, watch)
        if not started:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_LOST)).encode())]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": _LOST})


def proxy_middlewares() -> list[Middleware]:
    """The HTTP proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`): the middlewares Serve's proxy wraps
    its ASGI app in."""
    return [Middleware(LostReplicaMiddleware)]
