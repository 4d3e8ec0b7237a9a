"""Who and how much gets in: API key, request body size, queue length (ASGI middleware).

Runs before FastAPI parses anything, so an oversized or unauthorized request costs the
server nothing. Every refusal is an OpenAI-style error body:

- 401 `invalid_api_key`: a key is set (`--api-key` or `FLARE_API_KEY`) and the request's
  `Authorization: Bearer <key>` is missing or wrong, on every `/v1` route. The compare is
  `hmac.compare_digest` (constant time). `/health` is always open; `/metrics` and
  `/debug/state` are open unless `protect_metrics`.
- 413 `request_too_large`: the body exceeds `max_body_bytes` (by Content-Length, or while
  a chunked body is read).
- 429 `queue_full` with `Retry-After`: more requests are waiting than `max_queue` (the
  server-side EnqueueRejected).
- 500 `internal_error`: anything unexpected inside; answered here so the connection stays
  usable.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

log = logging.getLogger(__name__)

_OPEN_PATHS = {"/health"}
_STATS_PATHS = {"/metrics", "/debug/state"}


class _BodyTooLarge(Exception):
    pass


def keys_match(given: str, expected: str) -> bool:
    """Constant-time comparison of two API keys (time does not depend on a shared prefix)."""
    return hmac.compare_digest(given.encode(), expected.encode())


class RequestGuard:
    """ASGI middleware enforcing the API key, the body size limit and the queue limit.

    Args:
        app: the wrapped ASGI app.
        api_key: required bearer token, or None for an open server.
        max_body_bytes: largest accepted request body, bytes.
        protect_metrics: require the key on /metrics and /debug/state too.
        queue_length: returns how many requests wait for the engine now.
        max_queue: most waiting requests before new POSTs get 429.
    """

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int,
                 protect_metrics: bool, queue_length: Callable[[], int],
                 max_queue: int) -> None:
        self.app = app
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.protect_metrics = protect_metrics
        self.queue_length = queue_length
        self.max_queue = max_queue

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.api_key and self._needs_key(path) and not self._authorized(scope):
            await _refuse(send, 401, "Incorrect or missing API key: send "
                          "'Authorization: Bearer <key>'.", "invalid_api_key")
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _refuse(send, 413, f"request body of {int(length):,} bytes exceeds the "
                          f"limit of {self.max_body_bytes:,} bytes", "request_too_large")
            return
        if scope.get("method") == "POST" and self.queue_length() >= self.max_queue:
            await _refuse(send, 429, f"{self.max_queue} requests are already waiting; retry "
                          "shortly", "queue_full", retry_after=1)
            return
        seen = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _refuse(send, 413, f"request body exceeds the limit of "
                              f"{self.max_body_bytes:,} bytes", "request_too_large")
        except Exception:
            # answered here, not re-raised: an exception that reaches the server's outermost
            # layer makes uvicorn drop the keep-alive connection after the 500
            log.exception("unexpected error on %s", path)
            if not started:
                await _refuse(send, 500, "internal server error", "internal_error",
                              kind="server_error")

    def _needs_key(self, path: str) -> bool:
        if path in _OPEN_PATHS:
            return False
        if path in _STATS_PATHS:
            return self.protect_metrics
        return True

    def _authorized(self, scope: Scope) -> bool:
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and keys_match(token.strip(), self.api_key or "")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _refuse(send: Send, status: int, message: str, code: str,
                  retry_after: int | None = None, kind: str | None = None) -> None:
    kind = kind or ("invalid_request_error" if status != 429 else "rate_limit_error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
