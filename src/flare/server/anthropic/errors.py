"""Anthropic's error shape for the /v1/messages routes.

Every refusal on a `/v1/messages*` path, wherever it is decided (the guard middleware, the
request validation, the shared generation core, an unexpected exception), is answered as
Anthropic answers: `{"type": "error", "error": {"type": <error type>, "message": ...}}`
with the error type of the HTTP status (`ERROR_TYPES`), so the `anthropic` SDK raises its
matching exception class (BadRequestError, AuthenticationError, NotFoundError, ...).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from flare.server.api_error import ApiError

MESSAGES_PATH = "/v1/messages"

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}

# The queue is full: Anthropic's "overloaded" status (the server, not the client's rate).
OVERLOADED_STATUS = 529


def is_messages_path(path: str) -> bool:
    """Whether `path` belongs to the Anthropic surface (`/v1/messages` and below)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (`api_error` for other 5xx,
    `invalid_request_error` for other 4xx)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {"type": error_type(status), "message": message}}`."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def messages_status(exc: ApiError) -> int:
    """The status an `ApiError` of the shared core gets on this surface (the same, but a
    full queue is 529 overloaded)."""
    return OVERLOADED_STATUS if exc.code == "queue_full" else exc.status_code


def api_error_message(exc: ApiError) -> str:
    """The message of a shared-core `ApiError` in Anthropic's words where they differ: a
    prompt over the context starts "prompt is too long" (what agents look for to compact
    their conversation); a parameter's name leads the message, as Anthropic writes it."""
    message = exc.message
    if exc.code == "context_length_exceeded":
        return f"prompt is too long: {message}"
    if exc.param and not message.startswith(exc.param):
        return f"{exc.param}: {message}"
    return message


def error_response(status: int, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON response with Anthropic's error body."""
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def api_error_response(exc: ApiError) -> JSONResponse:
    """An `ApiError` (OpenAI fields) answered in Anthropic's shape."""
    return error_response(messages_status(exc), api_error_message(exc), exc.headers())
