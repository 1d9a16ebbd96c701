"""ASGI middleware of the omni server: a request-body size limit, a cross-origin guard and a log line per 4xx.

Both are plain ASGI (no `BaseHTTPMiddleware`), so streaming responses and WebSockets pass through untouched.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_omni.logger import init_logger

logger = init_logger(__name__)

MULTIPART_TYPES = (b"multipart/form-data", b"application/x-www-form-urlencoded")
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k == name), None)


async def _send_error(send: Send, status: int, message: str, param: str | None) -> None:
    body = json.dumps({"error": {"message": message, "type": "RequestEntityTooLarge" if status == 413 else
                                 "PermissionDeniedError", "param": param, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestBodyLimitMiddleware:
    """Refuses a body over `max_bytes` (multipart uploads: over `max_upload_bytes`) with 413: from the
    Content-Length header before reading anything, or as soon as a chunked body passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        content_type = _header(scope, b"content-type") or b""
        limit = max(self.max_bytes, self.max_upload_bytes) if content_type.startswith(MULTIPART_TYPES) \
            else self.max_bytes
        message = f"request body is over the {limit} byte limit (see --max-request-body-mb, --max-upload-mb)"
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(send, 413, message, "body")
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > limit:
                    raise HTTPException(status_code=413, detail=message)
            return msg

        await self.app(scope, limited_receive, send)


def origin_allowed(scope: Scope, allowed_origins: list[str]) -> bool:
    """No Origin header (not a browser), the server's own origin, or one of `--allowed-origins`."""
    origin = _header(scope, b"origin")
    if origin is None:
        return True
    value = origin.decode("latin-1")
    host = (_header(scope, b"host") or b"").decode("latin-1")
    return urlsplit(value).netloc == host or "*" in allowed_origins or value in allowed_origins


class OriginGuardMiddleware:
    """Cross-origin requests that change state need their origin in `--allowed-origins`: WebSocket handshakes
    (browsers send them cross-origin without a CORS check) and state-changing HTTP methods (a form POST is a
    CORS "simple request" that a foreign page can send; CORS only hides the answer). Reads are left to CORS."""

    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.allowed_origins = list(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "websocket" or (scope["type"] == "http" and scope["method"] in STATE_CHANGING)
        if not guarded or origin_allowed(scope, self.allowed_origins):
            await self.app(scope, receive, send)
            return
        reason = "cross-origin request refused: its Origin is not in --allowed-origins"
        if scope["type"] == "websocket":
            await receive()  # websocket.connect; closing before accept answers the handshake with 403
            await send({"type": "websocket.close", "code": 1008, "reason": reason})
            return
        await _send_error(send, 403, reason, "origin")


_LOGGED_BODY_BYTES = 4096


class ClientErrorLogMiddleware:
    """One INFO line per 4xx answer, with the reason from its error body, whichever route or middleware
    produced it (ours, vLLM's, a 413 before the body was read)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = b""

        async def send_and_log(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and 400 <= status < 500:
                body = (body + message.get("body", b""))[:_LOGGED_BODY_BYTES]
                if not message.get("more_body", False):
                    logger.info("%s %s -> %d: %s", scope["method"], scope["path"], status, _reason(body))
            await send(message)

        await self.app(scope, receive, send_and_log)


def _reason(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace")[:200] or "(no body)"
    if isinstance(error, dict):
        param = f" [param={error['param']}]" if error.get("param") else ""
        return f"{error.get('message')}{param}"
    return str(error)[:200]


def add_omni_middleware(app: Any, args: Any) -> None:
    app.add_middleware(OriginGuardMiddleware, allowed_origins=args.allowed_origins or [])
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=int(args.max_request_body_mb * 2**20),
                       max_upload_bytes=int(args.max_upload_mb * 2**20) + 2**20)
    app.add_middleware(ClientErrorLogMiddleware)  # outermost: sees the limits' and the guard's 4xx too
