"""HTTP client of `flare chat`: streamed chat completions and the session routes of a
Flare server (docs/api-extensions.md), over httpx.

Only what the terminal chat needs: the served model, one streamed turn (`ChatStream`,
OpenAI's SSE chunks plus the `flare` extension of the last one), and `GET`, `fork` and
`save` of a named session. Every failure is a `ChatError` whose message is the server's
own (OpenAI error body) or names the connection problem.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # one SSE event may wait behind a long prefill on a busy machine


class ChatError(Exception):
    """A request the server refused or could not answer; `status` is the HTTP status (None:
    no answer at all) and `code` the OpenAI error code when the body had one."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def _error_of(response: httpx.Response) -> ChatError:
    """The ChatError of a non-2xx response: its OpenAI error message when it has one."""
    try:
        err = response.json().get("error")
        message, code = err.get("message"), err.get("code")
    except (ValueError, AttributeError):
        message, code = response.text[:300] or response.reason_phrase, None
    return ChatError(f"HTTP {response.status_code}: {message}", response.status_code, code)


@dataclass(frozen=True)
class TurnStats:
    """Figures of one answered turn. Server durations come from one server clock (the
    `flare` extension's `timings`, docs/api-extensions.md), client durations from this
    process's `time.monotonic()`; the two are never mixed.

    Attributes:
        client_ttft_s: seconds from sending the request to the first text delta, as this
            client saw it (None: no text arrived).
        ttft_s: server clock, first_token_ns - arrival_ns, seconds (None: not reported).
        decode_tokens_per_s: server clock, completion tokens after the first over
            finished_ns - first_token_ns (None: fewer than two tokens or not reported).
        prompt_tokens, completion_tokens, cached_tokens: the response's usage (None:
            stopped before the usage chunk).
        tier: where the reused state came from ("device", "host", "disk"; None: nothing
            reused or not reported).
        outcome: the reuse outcome ("Admitted", "NoMatch", ...; None: not reported).
        finish_reason: "stop", "length", ...; "interrupted" when the client stopped it.
    """

    client_ttft_s: float | None = None
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    tier: str | None = None
    outcome: str | None = None
    finish_reason: str | None = None


def turn_stats(usage: dict | None, flare: dict | None, finish_reason: str | None,
               client_ttft_s: float | None) -> TurnStats:
    """TurnStats from a stream's usage chunk and `flare` extension (either may be None)."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    entry = ((flare or {}).get("choices") or [{}])[0] or {}
    timings, reuse = entry.get("timings") or {}, entry.get("reuse") or {}
    arrival, first, done = (timings.get(k) for k in ("arrival_ns", "first_token_ns",
                                                       "finished_ns"))
    ttft = (first - arrival) / 1e9 if first is not None and arrival is not None else None
    completion = usage.get("completion_tokens")
    rate = None
    if first is not None and done is not None and completion and completion > 1 and done > first:
        rate = (completion - 1) / ((done - first) / 1e9)
    return TurnStats(client_ttft_s=client_ttft_s, ttft_s=ttft, decode_tokens_per_s=rate,
                     prompt_tokens=usage.get("prompt_tokens"), completion_tokens=completion,
                     cached_tokens=details.get("cached_tokens"), tier=reuse.get("tier"),
                     outcome=reuse.get("outcome"), finish_reason=finish_reason)


class ChatStream:
    """One streamed chat completion. Iterate it for the answer's text deltas; afterwards
    `stats` holds the turn's figures. `close()` (also on an exception inside the loop, for
    example KeyboardInterrupt) closes the connection, which makes the server abort the
    request and free its pages.

    Raises (while iterating): ChatError for an HTTP error or an error event in the stream.
    """

    def __init__(self, http: httpx.Client, body: dict[str, Any]) -> None:
        self._http, self._body = http, body
        self._response: httpx.Response | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.flare: dict | None = None
        self.client_ttft_s: float | None = None

    def __iter__(self) -> Iterator[str]:
        sent = time.monotonic()
        request = self._http.build_request("POST", "/v1/chat/completions", json=self._body)
        try:
            self._response = self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ChatError(f"no answer from {self._http.base_url}: {exc}") from None
        try:
            if self._response.status_code != 200:
                self._response.read()
                raise _error_of(self._response)
            for line in self._response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"] or {}
                    raise ChatError(f"the server failed the answer: {err.get('message')}",
                                    200, err.get("code"))
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                if chunk.get("flare"):
                    self.flare = chunk["flare"]
                for choice in chunk.get("choices") or ():
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        if self.client_ttft_s is None:
                            self.client_ttft_s = time.monotonic() - sent
                        self.text += delta
                        yield delta
        except httpx.HTTPError as exc:
            raise ChatError(f"the stream from {self._http.base_url} broke: {exc}") from None
        finally:
            self.close()

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self._response is not None:
            self._response.close()

    @property
    def stats(self) -> TurnStats:
        """The turn's figures (finish_reason "interrupted" when no finish chunk came)."""
        return turn_stats(self.usage, self.flare, self.finish_reason or "interrupted",
                          self.client_ttft_s)


class FlareClient:
    """A Flare (or OpenAI-compatible) server at `url`.

    Args:
        url: base URL such as http://127.0.0.1:8000 (a trailing /v1 is accepted).
        api_key: sent as `Authorization: Bearer KEY` (None: no header).
    """

    def __init__(self, url: str, api_key: str | None = None) -> None:
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url
        self.http = httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(
            READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ChatError(f"no answer from {self.url}: {exc}") from None
        if r.status_code >= 400:
            raise _error_of(r)
        return r.json()

    def models(self) -> list[str]:
        """Ids of the served models (GET /v1/models). Raises ChatError."""
        return [m["id"] for m in self._call("GET", "/v1/models").get("data", [])]

    def stream_chat(self, model: str, messages: list[dict[str, str]], session: str | None,
                    **params: Any) -> ChatStream:
        """A streamed chat completion of `messages` naming `session`; `params` are request
        fields (`max_tokens`, `temperature`, `ignore_eos`, ...; None values are left out)."""
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}}
        if session:
            body["session"] = session
        body.update({k: v for k, v in params.items() if v is not None})
        return ChatStream(self.http, body)

    def session(self, name: str) -> dict[str, Any] | None:
        """GET /v1/sessions/NAME, or None when the server does not hold it (404).
        Raises ChatError for any other failure."""
        try:
            return self._call("GET", f"/v1/sessions/{name}")
        except ChatError as exc:
            if exc.status == 404:
                return None
            raise

    def fork(self, name: str, new: str) -> dict[str, Any]:
        """POST /v1/sessions/NAME/fork {"id": NEW}. Raises ChatError."""
        return self._call("POST", f"/v1/sessions/{name}/fork", json={"id": new})

    def save(self, name: str) -> dict[str, Any]:
        """POST /v1/sessions/NAME/save: the session's state to the disk tier. Raises
        ChatError (503 `no_disk_tier` on a server without a state folder)."""
        return self._call("POST", f"/v1/sessions/{name}/save")
