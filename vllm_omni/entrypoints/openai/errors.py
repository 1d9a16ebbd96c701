"""One place that turns every error into an OpenAI-style JSON body with the right HTTP status.

Client mistakes (bad JSON, wrong types, unknown fields, impossible values) are 4xx naming the field;
a dead engine is 503; only a genuine engine failure is 500.
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.exceptions import VLLMClientError, VLLMNotFoundError

from vllm_omni.entrypoints.openai.protocol.common import named_field
from vllm_omni.entrypoints.openai.vllm_route_guards import is_vllm_route, request_fields, vllm_route_error
from vllm_omni.errors import EngineDeadError, OmniClientError, OmniError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def error_json(message: str, status: int, *, error_type: str | None = None, param: str | None = None) -> JSONResponse:
    if error_type is None:
        error_type = "BadRequestError" if status < 500 else "InternalServerError"
        if status in (404, 405, 413, 503):
            error_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _describe_validation_errors(errors: list) -> tuple[str, str | None]:
    """Pydantic/FastAPI errors -> one readable message and the first offending field."""
    parts: list[str] = []
    first_param: str | None = None
    for err in errors:
        if not isinstance(err, dict):
            parts.append(str(err))
            continue
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, OmniClientError):  # raised by one of our validators: it knows the field
            parts.append(cause.message)
            first_param = first_param or cause.param
            continue
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        field = ".".join(loc)
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            parts.append(f"request body is not valid JSON: {ctx}".rstrip(": "))
            continue
        if err.get("type") == "missing":
            parts.append(f"missing required field '{field}'" if field else "the request body is missing (a JSON "
                         "object is expected)")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{field}'")
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{field}: {msg}" if field else msg)
        first_param = first_param or (field or None)
    return "; ".join(parts) or "invalid request", first_param


def exception_to_response(exc: BaseException, fields: Iterable[str] = ()) -> JSONResponse:
    """The error body for `exc`; a client error that names no field gets the first of the request's `fields`
    its message mentions."""
    if isinstance(exc, OmniClientError):
        return error_json(exc.message, exc.status_code, error_type=exc.error_type,
                          param=exc.param or named_field(exc.message, fields))
    if isinstance(exc, RequestValidationError | ValidationError):
        message, param = _describe_validation_errors(list(exc.errors()))
        return error_json(message, HTTPStatus.BAD_REQUEST, param=param or named_field(message, fields))
    if isinstance(exc, VLLMClientError):
        status = HTTPStatus.NOT_FOUND if isinstance(exc, VLLMNotFoundError) else HTTPStatus.BAD_REQUEST
        return error_json(str(exc), status, param=getattr(exc, "parameter", None) or named_field(str(exc), fields))
    if isinstance(exc, EngineDeadError):
        return error_json(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, error_type=exc.error_type)
    if isinstance(exc, OmniError):
        return error_json(str(exc), exc.status_code, error_type=exc.error_type)
    if isinstance(exc, StarletteHTTPException):
        return error_json(str(exc.detail), exc.status_code)
    logger.exception("Unhandled server error", exc_info=exc)
    return error_json(f"{type(exc).__name__}: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)


def register_exception_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        fields = request_fields(request)
        if is_vllm_route(request) and (answer := vllm_route_error(request, exc)) is not None:
            message, status, param = answer
            return error_json(message, status, param=param or named_field(message, fields))
        return exception_to_response(exc, fields)

    for exc_type in (OmniError, VLLMClientError, RequestValidationError, ValidationError, StarletteHTTPException,
                     NotImplementedError, ValueError, Exception):
        app.add_exception_handler(exc_type, handle)
