"""Checks in front of vLLM's own OpenAI routes (mounted for an AR-first pipeline, see `api_server.py`).

vLLM's request models let through what some of its handlers cannot take: a harmony `Message` in a chat
`messages` list (the chat renderer indexes messages as dicts: TypeError), and /detokenize ids past the
vocabulary (the tokenizer raises OverflowError). Each mounted route gets `guard_vllm_request` as its first
dependency, which checks the JSON body with vLLM's own types and checks before the handler runs. What vLLM's
handlers still raise is answered as vLLM answers it on `vllm serve` (a ValueError is the client's), except that
a route whose serving object this model lacks (the handler raises NotImplementedError) is a 404, not a 501.
"""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import HTTPConnection, Request
from vllm.renderers.chat_utils import (
    CustomChatCompletionMessageParam,
    OpenAIChatCompletionMessageParam,
    OpenAIHarmonyMessage,
)

from vllm_omni.errors import OmniClientError, OmniError

_CHAT_MESSAGE = TypeAdapter(OpenAIChatCompletionMessageParam | CustomChatCompletionMessageParam)
"""vLLM's chat message schema without its harmony alternative, which only the Responses API renders."""


def register_guarded_vllm_routers(args: argparse.Namespace, app: FastAPI, supported_tasks: tuple[str, ...]) -> None:
    """vLLM's routers (`register_api_routers`), every route added with `guard_vllm_request` first."""
    from vllm.entrypoints.launchers.api_server.routers import register_api_routers

    ours = app.router.dependencies
    app.router.dependencies = [Depends(guard_vllm_request), *ours]
    try:
        register_api_routers(args, app, supported_tasks)
    finally:
        app.router.dependencies = ours


async def guard_vllm_request(connection: HTTPConnection) -> None:
    """Refuses, naming the field, a JSON body that vLLM's request model accepts but its handler cannot take."""
    route = connection.scope.get("route")
    if not isinstance(connection, Request) or not isinstance(route, APIRoute) or route.body_field is None \
            or "json" not in connection.headers.get("content-type", ""):
        return  # no body, or a form: vLLM's JSON routes refuse other content types themselves
    try:
        body = await connection.json()
    except ValueError:
        return  # FastAPI answers a body that is not JSON
    if not isinstance(body, dict):
        return
    fields = _body_fields(route)
    if "messages" in fields and _mentions(fields["messages"], OpenAIHarmonyMessage):
        check_chat_messages(body.get("messages"))
    if "tokens" in fields and "tokens" in body:
        try:  # as the request model will read them: "7", 7.0 and 5e9 are ids too
            tokens = TypeAdapter(fields["tokens"]).validate_python(body["tokens"])
        except ValidationError as exc:
            raise OmniClientError(f"tokens: {exc.errors()[0]['msg']}", param="tokens") from None
        connection.app.state.engine_client.renderer.validate_token_ids(tokens, parameter="tokens")


def check_chat_messages(messages: Any) -> None:
    """Each message must be an OpenAI chat message (a harmony `{"author": ...}` one is not)."""
    if not isinstance(messages, list):
        return  # the request model refuses it
    for i, message in enumerate(messages):
        if isinstance(message, dict) and "role" not in message:
            raise OmniClientError(f"messages[{i}] has no 'role': it is not an OpenAI chat message",
                                  param=f"messages[{i}].role")
        try:
            _CHAT_MESSAGE.validate_python(message)
        except ValidationError as exc:
            raise OmniClientError(f"messages[{i}] is not an OpenAI chat message: {exc.errors()[0]['msg']}",
                                  param=f"messages[{i}]") from None


def _body_fields(route: APIRoute) -> dict[str, Any]:
    """{field name: annotation} over the route's body model (each member of a union of models)."""
    fields: dict[str, Any] = {}
    for model in _members(route.body_field.field_info.annotation):
        for name, info in getattr(model, "model_fields", {}).items():
            fields.setdefault(name, info.annotation)
    return fields


def _members(annotation: Any) -> Iterator[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType or origin is typing.Annotated:
        for arg in typing.get_args(annotation):
            yield from _members(arg)
    else:
        yield annotation


def _mentions(annotation: Any, target: type) -> bool:
    return annotation is target or any(_mentions(arg, target) for arg in typing.get_args(annotation))


def is_vllm_route(request: Request) -> bool:
    route = request.scope.get("route")
    return isinstance(route, APIRoute) and inspect.unwrap(route.endpoint).__module__.startswith("vllm.")


def vllm_route_error(request: Request, exc: BaseException) -> tuple[str, int] | None:
    """(message, status) for what vLLM's handler raised, when vLLM counts it as the client's; else None.

    NotImplementedError raised by the route function itself means its serving object is absent for this model
    (vLLM answers 501): the route is not served here, a 404. Raised deeper, it is a feature this request asks for
    that vLLM does not have (400). ValueError is how vLLM's request processing refuses input (vLLM: 400)."""
    if isinstance(exc, NotImplementedError):
        if _raised_by(exc, request.scope["route"].endpoint):
            return f"{request.url.path} is not served for this model: {exc}", HTTPStatus.NOT_FOUND
        return f"not supported: {exc}", HTTPStatus.BAD_REQUEST
    if isinstance(exc, ValueError) and not isinstance(exc, OmniError | ValidationError):
        return str(exc), HTTPStatus.BAD_REQUEST
    return None


def _raised_by(exc: BaseException, endpoint: Any) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is inspect.unwrap(endpoint).__code__
