"""Server limits: who and how much gets in, and for how long (ASGI middleware + helpers).

The middleware runs before FastAPI parses anything, so an oversized or unauthorized request
costs the server nothing. Every refusal is an OpenAI-style error body:

- 401 `invalid_api_key`: a key is set (`--api-key` or `FLARE_API_KEY`) and the request
  has neither `Authorization: Bearer <key>` nor `x-api-key: <key>` (Anthropic's header) with
  it, on every `/v1` route. The compare is `hmac.compare_digest` (constant time).
  `/health` is always open, and so are the web chat page and the API docs (`/`,
  `/web/...`, `/docs`, `/openapi.json`: files, no model; the page asks for the key for
  its API calls); `/metrics` and `/debug/state` are open unless `protect_metrics`.
- 413 `request_too_large`: the body exceeds `max_body_bytes` (by Content-Length, or while
  a chunked body is read: the 413 is sent the moment the limit is passed, whatever the
  route's body parser makes of the cut-off body; uvicorn discards the rest of the body as
  it arrives, so the client reads the 413 instead of a reset connection, and the header
  timeout bounds how long that may go on).
- 408 `body_timeout`: the body did not arrive in full within `body_timeout_s` seconds of
  the request's headers (a client that announces more bytes than it sends, or trickles
  them); the connection is closed. The headers themselves have their own limit, enforced
  where they are parsed (`flare.server.connection`).
- 429 `queue_full` with `Retry-After`: the queue bound `max_queue` would be passed
  (`flare.server.queue_bound.Admission`: sequences waiting in the engine plus those of
  POSTs that have passed this guard and are not queued there yet).
- 500 `internal_error`: anything unexpected inside; answered here so the connection stays
  usable.

Limits the routes apply once the body is parsed (helpers below):

- 400 `array_above_max_length`: a chat request with more messages than `--max-messages`
  (`check_message_count`).
- 400 `context_length_exceeded` before tokenizing: a prompt whose text is so long that it
  cannot fit the context whatever its tokens (`PromptBound`); a 10 MB prompt is refused in
  microseconds instead of seconds of tokenizer time. Shorter prompts are tokenized and
  checked exactly.
- 504 `request_timeout`: the request ran longer than `--request-timeout` seconds, counted
  from its arrival (`with_deadline`). Its engine requests are aborted, which frees their
  pages; a stream that has begun gets the error as an event, then `[DONE]`. 504 and not
  408: the request itself was complete and valid, the server gave up producing the answer
  (408 also tells HTTP clients the connection is being closed); the `openai` SDKs treat it
  as a server error and retry it (`max_retries`).

On the Anthropic routes (`/v1/messages*`) the same refusals use Anthropic's error body
(`flare.server.anthropic.errors`), and a full queue is 529 `overloaded_error`.

`ServerCounters` counts what the engine never sees (responses by status, timeouts) for
/metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from flare.runtime.async_engine import on_enqueued
from flare.server.anthropic import errors as anthropic_errors
from flare.server.api_error import ApiError
from flare.server.queue_bound import Admission, current_ticket

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

log = logging.getLogger(__name__)

T = TypeVar("T")

_OPEN_PATHS = {"/health", "/", "/docs", "/openapi.json"}
_OPEN_PREFIXES = ("/web/",)  # the web chat's static files (flare.server.web)
_STATS_PATHS = {"/metrics", "/debug/state"}


class _BodyRefused(Exception):
    """Raised into the route's body reader after the guard has answered the request."""


class ServerCounters(Collector):
    """HTTP-side counters for /metrics (a prometheus `Collector`; thread-safe).

    Exposed as `flare_http_responses_total{code="..."}` (responses by HTTP status, a
    stream counted by its 200 when it starts) and `flare_request_timeouts_total` (requests
    that ran past `--request-timeout`, streamed or not).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Counter[int] = Counter()
        self.request_timeouts = 0

    def count_response(self, status: int) -> None:
        with self._lock:
            self.responses[status] += 1

    def count_timeout(self) -> None:
        with self._lock:
            self.request_timeouts += 1

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            responses = sorted(self.responses.items())
            timeouts = self.request_timeouts
        family = CounterMetricFamily("flare_http_responses",
                                     "HTTP responses sent, by status code", labels=["code"])
        for status, count in responses:
            family.add_metric([str(status)], count)
        yield family
        yield CounterMetricFamily("flare_request_timeouts",
                                  "requests aborted by --request-timeout", value=timeouts)


def check_message_count(num_messages: int, limit: int) -> None:
    """Refuse a chat request with more than `limit` messages.

    Raises:
        ApiError: 400 `array_above_max_length` naming the count and the limit.
    """
    if num_messages > limit:
        raise ApiError(400, f"messages has {num_messages} entries; this server accepts at "
                            f"most {limit} per request (flare serve --max-messages).",
                       param="messages", code="array_above_max_length")


class PromptBound:
    """A lower bound on a text's token count, from its length alone.

    One token decodes to at most `longest` characters, the length of the longest string in
    the vocabulary (byte-level BPE writes one character per byte, SentencePiece one per
    character or a longer `<0xNN>` per byte), so a text of C characters has at least
    C / longest tokens. A tokenizer's normalizer may shorten text before it is split
    (Unicode composition joins up to three code points into one), hence `SLACK`: the bound
    used is C / (longest * SLACK), which never exceeds the true count.

    Args:
        tokenizer: a transformers tokenizer (`get_vocab()` maps token strings to ids).
        max_seq_len: the package's context length, tokens.
    """

    SLACK = 4

    def __init__(self, tokenizer: Any, max_seq_len: int) -> None:
        self.longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_seq_len = max_seq_len

    @property
    def max_chars(self) -> int:
        """Longest text, in characters, that may still fit the context."""
        return self.max_seq_len * self.longest * self.SLACK

    def check(self, num_chars: int, param: str) -> None:
        """Refuse text of `num_chars` characters that cannot fit the context.

        Raises:
            ApiError: 400 `context_length_exceeded` naming the bound.
        """
        if num_chars > self.max_chars:
            at_least = num_chars // (self.longest * self.SLACK)
            raise ApiError(400, f"This model's maximum context length is {self.max_seq_len} "
                                f"tokens. However, your prompt has {num_chars:,} characters, "
                                f"at least {at_least:,} tokens (one token is at most "
                                f"{self.longest} characters).",
                           param=param, code="context_length_exceeded")


async def with_deadline(stream: AsyncIterator[T], deadline: float, timeout_s: float,
                        counters: ServerCounters | None = None) -> AsyncIterator[T]:
    """Yield `stream`'s items until `deadline`, then stop it and raise.

    Args:
        stream: an async iterator (the merged engine streams of one request); it is closed
            (`aclose`) however this ends, which aborts its engine requests.
        deadline: `time.monotonic()` value (s) after which no more items are awaited.
        timeout_s: the configured timeout (s), for the message.
        counters: where the timeout is counted, if given.

    Raises:
        ApiError: 504 `request_timeout` when the deadline passes before `stream` ends.
    """
    try:
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                # cancelling the pending step closes the stream's engine requests
                item = await asyncio.wait_for(stream.__anext__(), remaining)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if counters is not None:
                    counters.count_timeout()
                raise ApiError(504, f"the request did not finish within the server's request "
                                    f"timeout of {timeout_s:g} s (flare serve --request-timeout)"
                                    "; its generation was stopped.",
                               type="server_error", code="request_timeout") from None
            yield item
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def keys_match(given: str, expected: str) -> bool:
    """Constant-time comparison of two API keys (time does not depend on a shared prefix)."""
    return hmac.compare_digest(given.encode(), expected.encode())


class RequestGuard:
    """ASGI middleware enforcing the API key, the body size and time limits and the queue
    limit.

    Args:
        app: the wrapped ASGI app.
        api_key: required bearer token, or None for an open server.
        max_body_bytes: largest accepted request body, bytes.
        protect_metrics: require the key on /metrics and /debug/state too.
        queue_length: returns how many requests wait for the engine now.
        max_queue: most waiting requests before new POSTs get 429 (see `Admission`).
        counters: counts every response by status, refusals included (None: not counted).
        body_timeout_s: seconds the whole body may take to arrive, from the request's
            start (None: no limit).
    """

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int,
                 protect_metrics: bool, queue_length: Callable[[], int],
                 max_queue: int, counters: ServerCounters | None = None,
                 body_timeout_s: float | None = None) -> None:
        self.app = app
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.protect_metrics = protect_metrics
        self.admission = Admission(queue_length, max_queue)
        self.max_queue = max_queue
        self.counters = counters
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        send = self._counting(send)
        if self.api_key and self._needs_key(path) and not self._authorized(scope):
            await _refuse(send, 401, "Incorrect or missing API key: send "
                          "'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                          "invalid_api_key", path=path)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _refuse(send, 413, f"request body of {int(length):,} bytes exceeds the "
                          f"limit of {self.max_body_bytes:,} bytes", "request_too_large",
                          path=path)
            return
        ticket = None
        if scope.get("method") == "POST":
            ticket = self.admission.take()
            if ticket is None:
                await _refuse(send, 429, f"{self.max_queue} requests are already waiting; "
                              "retry shortly", "queue_full", retry_after=1, path=path)
                return
        token = on_enqueued.set(ticket.enqueued if ticket is not None else None)
        ticket_token = current_ticket.set(ticket)
        try:
            await self._serve(scope, receive, send, path)
        finally:
            current_ticket.reset(ticket_token)
            on_enqueued.reset(token)
            if ticket is not None:
                ticket()

    async def _serve(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        seen = 0
        started = refused = body_done = False
        deadline = (time.monotonic() + self.body_timeout_s
                    if self.body_timeout_s is not None else None)

        async def refuse(status: int, message: str, code: str, close: bool) -> None:
            nonlocal started, refused
            if not started:
                started = refused = True
                await _refuse(send, status, message, code, path=path, close=close)

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen, body_done
            if body_done or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    await refuse(408, f"the request body did not arrive within "
                                 f"{self.body_timeout_s:g} s (flare serve --body-timeout)",
                                 "body_timeout", close=True)  # a stalled client: hang up
                    raise _BodyRefused from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = body_done or not message.get("more_body", False)
                if seen > self.max_body_bytes:
                    await refuse(413, f"request body exceeds the limit of "
                                 f"{self.max_body_bytes:,} bytes", "request_too_large",
                                 close=False)  # uvicorn discards the rest as it arrives
                    raise _BodyRefused
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:  # the guard has answered; what the route makes of it goes nowhere
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyRefused:
            pass
        except Exception:
            # answered here, not re-raised: an exception that reaches the server's outermost
            # layer makes uvicorn drop the keep-alive connection after the 500
            log.exception("unexpected error on %s", path)
            if not started:
                started = True
                await _refuse(send, 500, "internal server error", "internal_error",
                              kind="server_error", path=path)

    def _counting(self, send: Send) -> Send:
        counters = self.counters
        if counters is None:
            return send

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                counters.count_response(message["status"])
            await send(message)

        return counting_send

    def _needs_key(self, path: str) -> bool:
        if path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES):
            return False
        if path in _STATS_PATHS:
            return self.protect_metrics
        return True

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer <key>` (OpenAI's) or `x-api-key: <key>` (Anthropic's)."""
        expected = self.api_key or ""
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and keys_match(token.strip(), expected):
            return True
        key = _header(scope, b"x-api-key")
        return key is not None and keys_match(key.strip(), expected)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _refuse(send: Send, status: int, message: str, code: str,
                  retry_after: int | None = None, kind: str | None = None,
                  path: str = "", close: bool = False) -> None:
    if anthropic_errors.is_messages_path(path):
        if code == "queue_full":
            status = anthropic_errors.OVERLOADED_STATUS
        payload: dict[str, Any] = anthropic_errors.error_body(status, message)
    else:
        kind = kind or ("invalid_request_error" if status != 429 else "rate_limit_error")
        payload = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def unencodable_text(param: str) -> ApiError:
    """The 400 for text the tokenizer cannot take: in practice a lone UTF-16 surrogate
    (`"\\ud800"` in the JSON), which is no Unicode character. Said in the request's terms,
    never the tokenizer's (whose own message names its internal types)."""
    return ApiError(400, f"{param} contains text that is not valid Unicode (a lone surrogate "
                         "escape such as \\ud800, half of a UTF-16 pair); send whole "
                         "characters.", param=param, code="invalid_unicode")
