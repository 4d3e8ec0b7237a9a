"""The error every API surface raises, `ApiError`, with OpenAI's error body
`{"error": {message, type, param, code}}`, and the turning of pydantic's validation errors
into one 400 that names the parameter. Anthropic's surface maps `ApiError` to its own body
(`flare.server.anthropic.errors`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


class ApiError(Exception):
    """An error answered to the client with OpenAI's error body.

    Args:
        status_code: HTTP status (400 invalid request, 404 unknown model, 500 server fault).
        message: human-readable; names the offending value and the limit where there is one.
        type: OpenAI error type ("invalid_request_error", "server_error", ...).
        param: the request parameter at fault, e.g. "messages[2].content", or None.
        code: machine-readable code, e.g. "context_length_exceeded", or None.
        retry_after_s: seconds for a `Retry-After` header (a 429 the client may retry),
            or None.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str] | None:
        """The response headers the error asks for (`Retry-After`), or None."""
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ParamError(ValueError):
    """A validator's error about a parameter other than the field it validates.

    Raised inside a pydantic validator; `validation_error` reports `param` (relative to the
    request body, e.g. "messages[3].tool_call_id") instead of the validated field, and
    `code` (e.g. "invalid_session_name") as the error's code.
    """

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _format_loc(loc: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str):
            # Pydantic names the union branch it tried ("str", "list[int]",
            # "function-after[...]"); those are not request parameters.
            if "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"}:
                continue
            out += f".{part}" if out else part
    return out or None


def messages_at(errors: Sequence[Mapping[str, Any]], where: str | None,
                locate: Callable[[Sequence[Any]], str | None]) -> str:
    """The distinct messages of the errors at `where`, joined with " or " (a union fails
    once per branch). `locate` turns an error's `loc` into the surface's parameter path;
    pydantic's "Value error, " prefix is dropped."""
    msgs: list[str] = []
    for err in errors:
        if locate(err.get("loc", ())) != where:
            continue
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if msg not in msgs:
            msgs.append(msg)
    return " or ".join(msgs)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """Turn pydantic/FastAPI validation errors into one 400 `ApiError` naming the parameter.

    The first failing parameter is reported; when it failed every branch of a union, the
    branches' messages are joined with " or ". A value of the wrong JSON type is "Invalid
    type for '<param>'", as OpenAI words it; a `ParamError` names its own parameter.
    """
    if not errors:
        return ApiError(400, "Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return ApiError(400, f"Invalid JSON body: {detail}", code="invalid_json")
    param = _format_loc(first.get("loc", ()))
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return ApiError(400, f"Invalid value for '{cause.param}': {cause}", param=cause.param,
                        code=cause.code)
    message = messages_at(errors, param, _format_loc)
    if param is None:
        return ApiError(400, f"Invalid request body: {message}")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param)
    if str(first.get("type", "")).endswith("_type"):  # int_type, bool_type, string_type...
        return ApiError(400, f"Invalid type for '{param}': {message}", param=param)
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param)
