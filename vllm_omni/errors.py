"""One error hierarchy for the whole stack; the HTTP layer maps it to status codes in one place.

Client errors (4xx) say which field is wrong; engine errors say whether the engine can go on.
"""

from __future__ import annotations


class OmniError(Exception):
    """Base of every error vllm-omni raises on purpose."""

    status_code: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, *args: object, status_code: int | None = None) -> None:
        super().__init__(*args)
        if status_code is not None:  # e.g. 503 (asleep) or 504 (timed out) without a subclass each
            self.status_code = status_code
            self.error_type = _default_error_type(status_code)


class OmniClientError(OmniError, ValueError):
    """The request is invalid; nothing else is affected. `param` names the offending field."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        error_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type or _default_error_type(status_code)
        self.param = param

    def __reduce__(self):
        return (_rebuild_client_error, (self.message, self.status_code, self.error_type, self.param))


def _rebuild_client_error(message: str, status_code: int, error_type: str, param: str | None):
    return OmniClientError(message, status_code=status_code, error_type=error_type, param=param)


def _default_error_type(status_code: int) -> str:
    return {
        400: "BadRequestError",
        404: "NotFoundError",
        413: "RequestEntityTooLarge",
        422: "UnprocessableEntityError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
        504: "GatewayTimeoutError",
    }.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")


def client_error_from_metadata(message: str, *, status_code: int | None, error_type: str | None,
                               param: str | None = None) -> OmniError:
    """Rebuild an error that crossed a process boundary as (message, status, type, the field it names)."""
    if status_code == RequestAbortedError.status_code:
        return RequestAbortedError(message)
    if status_code is not None and 400 <= status_code < 500:
        return OmniClientError(message, status_code=status_code, error_type=error_type, param=param)
    if status_code == StageRestartingError.status_code:
        return StageRestartingError(message)
    return EngineGenerateError(message)


class EngineGenerateError(OmniError, RuntimeError):
    """A request failed inside the engine; the engine itself is still healthy."""

    status_code = 500
    error_type = "InternalServerError"


class RequestAbortedError(OmniError):
    """The request was aborted while it ran; its work stopped and only it leaves the batch."""

    status_code = 499
    error_type = "aborted"

    def __init__(self, message: str = "request aborted") -> None:
        super().__init__(message)

class StageRestartingError(OmniError, RuntimeError):
    """A stage lost a worker and is restarting it: the requests it was running failed, later ones are
    served once it is back. Unlike `EngineDeadError` the engine stays alive."""

    status_code = 503
    error_type = "ServiceUnavailableError"


class EngineDeadError(OmniError, RuntimeError):
    """The engine (or one of its processes) died; every in-flight and future request fails fast."""

    status_code = 503
    error_type = "ServiceUnavailableError"

    def __init__(self, message: str = "The engine is dead; restart the server or create a new engine.") -> None:
        super().__init__(message)
