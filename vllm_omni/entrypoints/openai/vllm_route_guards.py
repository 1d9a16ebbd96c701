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
    MM_PARSER_MAP,
    TEXT_PART_TYPES,
    CustomChatCompletionMessageParam,
    OpenAIChatCompletionMessageParam,
    OpenAIHarmonyMessage,
)

from vllm_omni.entrypoints.openai.protocol.chat import check_messages, materialize_content
from vllm_omni.entrypoints.openai.protocol.common import (
    MAX_JSON_DEPTH,
    check_json_values,
    field_path,
    first_invalid_field,
    tagged_error,
)
from vllm_omni.errors import OmniClientError, OmniError

_CHAT_MESSAGE = TypeAdapter(OpenAIChatCompletionMessageParam | CustomChatCompletionMessageParam)
"""vLLM's chat message schema without its harmony alternative, which only the Responses API renders."""
INT64_RANGE = (-(2**63), 2**63 - 1)
NON_MEDIA_PART_TYPES = TEXT_PART_TYPES | {"tool_reference", "prompt_embeds"}
"""Content part types that carry no image, audio or video (prompt embeds are vLLM's own `--enable-prompt-embeds`)."""


def register_guarded_vllm_routers(args: argparse.Namespace, app: FastAPI, supported_tasks: tuple[str, ...],
                                  first: Any = None) -> None:
    """vLLM's routers (`register_api_routers`), every route added with `guard_vllm_request` first (after
    `first`, a dependency that runs before it)."""
    from vllm.entrypoints.launchers.api_server.routers import register_api_routers

    ours = app.router.dependencies
    app.router.dependencies = [*([first] if first is not None else []), Depends(guard_vllm_request), *ours]
    try:
        register_api_routers(args, app, supported_tasks)
    finally:
        app.router.dependencies = ours


async def guard_vllm_request(connection: HTTPConnection) -> None:
    """Refuses, naming the field, a JSON body that vLLM's request model accepts but its handler cannot take, or
    that makes vLLM's request model itself raise (its `mode="before"` validators assume each field's shape)."""
    route = connection.scope.get("route")
    if not isinstance(connection, Request) or not isinstance(route, APIRoute) \
            or "json" not in connection.headers.get("content-type", ""):
        return  # no body, or a form: vLLM's JSON routes refuse other content types themselves
    try:
        body = await connection.json()
    except RecursionError:
        raise OmniClientError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        return  # FastAPI answers a body that is not JSON
    if not isinstance(body, dict):
        if route.body_field is None:  # a route that reads the JSON itself (/invocations)
            raise OmniClientError("the request body must be a JSON object")
        return  # the request model refuses it
    check_vllm_body(connection, route, body)


def check_vllm_body(connection: Request, route: APIRoute, body: dict[str, Any]) -> None:
    """The checks of `guard_vllm_request` on a JSON object body, in the order that names the narrowest field."""
    fields = _body_fields(route) if route.body_field is not None else {}
    if "tokens" in fields and "tokens" in body:
        try:  # as the request model will read them: "7", 7.0 and 5e9 are ids too
            tokens = TypeAdapter(fields["tokens"]).validate_python(body["tokens"])
        except ValidationError as exc:
            raise OmniClientError(f"tokens: {exc.errors()[0]['msg']}", param="tokens") from None
        connection.app.state.engine_client.renderer.validate_token_ids(tokens, parameter="tokens")
    check_json_values(body, INT64_RANGE)  # vLLM hands fields to its engine process through msgspec
    _check_request_template(connection, body)
    if route.body_field is None:
        if "messages" in body:  # /invocations dispatches a chat body to vLLM's chat serving
            check_messages(body["messages"])
            _check_messages(connection, body["messages"])
        return
    for name in ("messages", "input", "prompt"):  # vLLM: "Cannot apply chat template to an empty conversation"
        if name in fields and body.get(name) in ([], {}):
            raise OmniClientError(f"{name} must not be empty", param=name)
    if "messages" in fields and _mentions(fields["messages"], OpenAIHarmonyMessage):
        _check_messages(connection, body.get("messages"))
    if "input" in fields and isinstance(body.get("input"), list):
        _check_response_input(connection, body["input"])
    _validate_as_the_handler(route, body)


def _validate_as_the_handler(route: APIRoute, body: dict[str, Any]) -> None:
    """The body validated as FastAPI will for the handler: a validator of vLLM's that raises TypeError or
    AttributeError on a field of another shape is the field's error, and lazily validated content is read."""
    try:
        request, errors = route.body_field.validate(body)
    except (TypeError, AttributeError) as exc:
        raise first_invalid_field(body, *_members(route.body_field.field_info.annotation)) \
            or OmniClientError(f"invalid request: {exc}") from exc
    if not errors and isinstance(getattr(request, "messages", None), list):
        materialize_content(request.messages, body["messages"])


def _check_request_template(connection: Request, body: dict[str, Any]) -> None:
    """vLLM's --trust-request-chat-template gate, naming the field (vLLM's serving answers without one)."""
    kwargs = body.get("chat_template_kwargs")
    named = "chat_template" if body.get("chat_template") is not None else "chat_template_kwargs.chat_template" \
        if isinstance(kwargs, dict) and kwargs.get("chat_template") is not None else None
    if named and not getattr(connection.app.state.args, "trust_request_chat_template", False):
        raise OmniClientError(f"{named}: a request chat template is refused unless the server runs with "
                              "--trust-request-chat-template", param=named)


def _check_messages(connection: Request, messages: Any) -> None:
    state = connection.app.state
    check_chat_messages(messages, state.engine.capabilities.input_modalities - {"text"}, state.model_name)


def _check_response_input(connection: Request, items: list[Any]) -> None:
    """Responses API input items: their media parts only for a model that takes them (vLLM answers "<model
    path> is not a multimodal model"). The rest is vLLM's to check."""
    state = connection.app.state
    media = state.engine.capabilities.input_modalities - {"text"}
    for i, item in enumerate(items):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in NON_MEDIA_PART_TYPES:
                _check_modality(kind, f"input[{i}].content[{j}]", media, state.model_name)


def check_chat_messages(messages: Any, media: frozenset[str] | set[str] = frozenset(), model: str = "") -> None:
    """Each message must be an OpenAI chat message (a harmony `{"author": ...}` one is not), and each content
    part one that vLLM parses and this model takes (`media`: the modalities it takes besides text). vLLM would
    name the part's key only (`type`), or a pydantic union path, or answer "<model path> is not a multimodal
    model"."""
    if not isinstance(messages, list):
        return  # the request model refuses it
    for i, message in enumerate(messages):
        if isinstance(message, dict) and "role" not in message:
            raise OmniClientError(f"messages[{i}] has no 'role': it is not an OpenAI chat message",
                                  param=f"messages[{i}].role")
        try:
            _CHAT_MESSAGE.validate_python(message)
        except ValidationError as exc:
            error = tagged_error(exc.errors())
            where = f"messages[{i}]{field_path(message, error['loc'])}"
            raise OmniClientError(f"{where} is not an OpenAI chat message: {error['msg']}", param=where) from None
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict):
                check_content_part(part, f"messages[{i}].content[{j}]", media, model)


def check_content_part(part: dict[str, Any], where: str, media: frozenset[str] | set[str], model: str) -> None:
    """A part vLLM's chat parser takes (its type, or a media key for a type-less part), and media only for a
    model that takes it."""
    kind = part.get("type")
    if kind is None:  # vLLM reads a type-less part by its key: {"image_url": ...}
        kind = next((key for key in MM_PARSER_MAP if key in part and key not in TEXT_PART_TYPES), None)
        if kind is None:
            raise OmniClientError(f"{where} has no 'type'", param=f"{where}.type")
    if not isinstance(kind, str) or kind not in MM_PARSER_MAP:
        raise OmniClientError(f"{where}.type: unsupported content part type {kind!r} (supported: "
                              f"{', '.join(sorted(MM_PARSER_MAP))})", param=f"{where}.type")
    if kind not in NON_MEDIA_PART_TYPES:
        _check_modality(kind, where, media, model)
    if part.get("type") is not None:
        try:
            MM_PARSER_MAP[kind](part)  # vLLM's own reading of the part (it validates URL objects)
        except ValidationError as exc:
            error = exc.errors()[0]
            at = f"{where}{field_path(part, error['loc'])}"
            raise OmniClientError(f"{at}: {error['msg']}", param=at) from None


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
    """Whether vLLM's routers added the route (it is guarded): its endpoint may be wrapped by other packages'
    decorators (SageMaker's /invocations)."""
    route = request.scope.get("route")
    return isinstance(route, APIRoute) and any(dep.dependency is guard_vllm_request for dep in route.dependencies)


def vllm_route_error(request: Request, exc: BaseException) -> tuple[str, int, str | None] | None:
    """(message, status, param) for what vLLM's handler raised, when vLLM counts it as the client's; else None.

    NotImplementedError raised by the route function itself means its serving object is absent for this model
    (vLLM answers 501): the route is not served here, a 404. Raised deeper, it is a feature this request asks for
    that vLLM does not have (400). ValueError is how vLLM's request processing refuses input (vLLM: 400)."""
    if isinstance(exc, NotImplementedError):
        if _raised_by(exc, request.scope["route"].endpoint):
            return f"{request.url.path} is not served for this model: {exc}", HTTPStatus.NOT_FOUND, None
        return f"not supported: {exc}", HTTPStatus.BAD_REQUEST, None
    if isinstance(exc, ValueError) and not isinstance(exc, OmniError | ValidationError):
        return str(exc), HTTPStatus.BAD_REQUEST, getattr(exc, "parameter", None)
    return None


def request_fields(request: Request) -> list[str]:
    """The body fields of the request's route (none for a route that reads its body itself)."""
    route = request.scope.get("route")
    return list(_body_fields(route)) if isinstance(route, APIRoute) and route.body_field is not None else []


def _raised_by(exc: BaseException, endpoint: Any) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is inspect.unwrap(endpoint).__code__


def _check_modality(kind: str, where: str, media: frozenset[str] | set[str], model: str) -> None:
    modality = next((m for m in ("image", "audio", "video") if m in kind), None)
    if modality is None or modality not in media:
        takes = f"takes {sorted(media | {'text'})}" if media else "takes text only"
        raise OmniClientError(f"{where}: `{model}` {takes}; a {kind!r} part cannot be given to it", param=where)
