"""The harness's HTTP/SSE client: one streamed request in, one raw observation out.

Clocks: every client timestamp is `time.monotonic_ns()` in this process (domain
`client_monotonic_ns`): the send time (just before the request is handed to httpx), the
time the response headers arrived, the receive time of each SSE event, and the end (stream
finished, failed, or closed by us). Server timestamps are copied verbatim from the server's
`flare` response extension (domain `server_monotonic_ns`) and never combined with ours.

An SSE event keeps one receive time whatever it carries. Its `tokens` are counted from its
text with the package's tokenizer when one is given (else null: unknown, never 0). Two
token-carrying events read at the very same nanosecond are recorded as one (coalesced)
event: the client cannot tell them apart in time, and must not pretend to.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from flare.evidence.clocks import CLIENT, SERVER

TokenCounter = Callable[[str], int]
TIMING_KEYS = ("arrival_ns", "scheduled_ns", "first_token_ns", "finished_ns")


def prompt_digest(prompt: Any) -> tuple[str, int]:
    """sha256 and size (characters, or token ids) of a prompt: messages, text or token ids."""
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    size = len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) \
        else len(text)
    return hashlib.sha256(text.encode("utf-8")).hexdigest(), size


class RouteError(RuntimeError):
    """A side route (not a measured request) answered with an error status."""


class Client:
    """Streams requests to an OpenAI-compatible server and records observations.

    Args:
        base_url: "http://host:port" (no /v1).
        model: the model name to send.
        count_tokens: text -> token count (the package's tokenizer), or None.
        timeout: seconds for connect and between reads.
        transport: an httpx transport (tests).
    """

    def __init__(self, base_url: str, model: str, count_tokens: TokenCounter | None = None,
                 timeout: float = 300.0, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.count_tokens = count_tokens
        self._timeout = timeout
        self._transport = transport
        self.http = self._new_http()
        self.fingerprint: str | None = None  # the last system_fingerprint the server sent

    def _new_http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(self._timeout),
                            transport=self._transport)

    def close(self) -> None:
        self.http.close()

    def reconnect(self) -> None:
        """Drop every pooled connection (the server was restarted on the same address)."""
        self.http.close()
        self.http = self._new_http()

    # ------------------------------------------------------------------ side routes

    def get_json(self, path: str) -> Any:
        r = self.http.get(path)
        r.raise_for_status()
        return r.json()

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST a JSON body to a side route (not an observation); its JSON answer.

        Raises:
            RouteError: any status but 200 (the message names the route and the error).
        """
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            err = _http_error(r.status_code, r.content)
            raise RouteError(f"POST {path} {json.dumps(body)}: HTTP {r.status_code} "
                             f"{err['type']}: {err['message']}")
        return r.json()

    # ------------------------------------------------------------------ requests

    def chat(self, messages: list[dict[str, Any]], max_tokens: int, *,
             cancel_after_first_token: bool = False) -> tuple[dict[str, Any], str]:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        return self._stream("/v1/chat/completions", body, messages, cancel_after_first_token)

    def completion(self, prompt: str | list[int], max_tokens: int, *,
                   cancel_after_first_token: bool = False) -> tuple[dict[str, Any], str]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        return self._stream("/v1/completions", body, prompt, cancel_after_first_token)

    def _tokens(self, text: str) -> int | None:
        if self.count_tokens is None:
            return None
        return self.count_tokens(text) if text else 0

    def _stream(self, endpoint: str, body: dict[str, Any], prompt: Any,
                cancel: bool) -> tuple[dict[str, Any], str]:
        """Send one streamed request; return (observation fields, completion text).

        The observation lacks the harness's bookkeeping (seq, request_id, scenario, group,
        session, turn), which the caller adds."""
        digest, size = prompt_digest(prompt)
        events: list[dict[str, Any]] = []
        text_parts: list[str] = []
        status, error, finish = "ok", None, None
        usage = ext = response_id = None
        headers_ns = None
        saw_done = False
        chat = endpoint.endswith("chat/completions")
        zero = 0 if self.count_tokens is not None else None  # tokens of a textless event
        send_ns = time.monotonic_ns()
        try:
            with self.http.stream("POST", endpoint, json=body) as resp:
                headers_ns = time.monotonic_ns()
                if resp.status_code != 200:
                    raw = resp.read()
                    status = "failed"
                    error = _http_error(resp.status_code, raw)
                else:
                    for line in resp.iter_lines():
                        t = time.monotonic_ns()
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            events.append(_event(t, "done", zero, 0))
                            saw_done = True
                            continue
                        try:
                            chunk = json.loads(data)
                        except json.JSONDecodeError:
                            events.append(_event(t, "other", zero, 0))
                            continue
                        response_id = chunk.get("id", response_id)
                        self.fingerprint = chunk.get("system_fingerprint") or self.fingerprint
                        if "flare" in chunk:
                            ext = chunk["flare"]
                        if chunk.get("error"):
                            err = chunk["error"]
                            events.append(_event(t, "error", zero, 0))
                            status = "failed"
                            error = {"http_status": 200, "type": str(err.get("type") or "error"),
                                     "message": str(err.get("message") or err)[:500]}
                            continue
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        kind, delta, fin = _classify(chunk, chat)
                        if fin:
                            finish = fin
                        if kind == "content":
                            text_parts.append(delta)
                            n = self._tokens(delta)
                            last = events[-1] if events else None
                            if (last is not None and last["t_ns"] == t
                                    and last["type"] == "content"):
                                # same instant as the previous event: one coalesced event
                                last["tokens"] = (None if n is None or last["tokens"] is None
                                                  else last["tokens"] + n)
                                last["chars"] += len(delta)
                            else:
                                events.append(_event(t, "content", n, len(delta)))
                        else:
                            events.append(_event(t, kind, zero, 0))
                        if cancel and kind == "content":
                            status = "cancelled"
                            error = {"http_status": None, "type": "cancelled",
                                     "message": "client disconnected after the first "
                                                "token-carrying event"}
                            break  # leaving the block closes the connection
        except httpx.HTTPError as exc:
            status = "failed"
            error = {"http_status": None, "type": type(exc).__name__, "message": str(exc)[:500]}
        end_ns = time.monotonic_ns()
        if status == "ok" and (not saw_done or finish is None):
            status = "failed"
            error = {"http_status": 200, "type": "incomplete_stream",
                     "message": "stream ended without "
                                + ("[DONE]" if not saw_done else "a finish_reason")}
        server, server_unavailable, reuse = _server_fields(ext, status)
        obs = {
            "endpoint": endpoint,
            "stream": True,
            "request": {"max_tokens": body["max_tokens"], "prompt_sha256": digest,
                        "prompt_chars": size,
                        "messages": len(prompt) if chat else None},
            "status": status,
            "error": error,
            "finish_reason": finish,
            "client": {"clock": CLIENT, "send_ns": send_ns, "headers_ns": headers_ns,
                       "end_ns": end_ns, "events": events},
            "usage": _usage(usage),
            "server": server,
            "server_unavailable": server_unavailable,
            "reuse": reuse,
            "response_id": response_id,
        }
        return obs, "".join(text_parts)


def _event(t: int, kind: str, tokens: int | None, chars: int) -> dict[str, Any]:
    return {"t_ns": t, "type": kind, "tokens": tokens, "chars": chars}


def _classify(chunk: dict[str, Any], chat: bool) -> tuple[str, str, str | None]:
    """(event type, content text, finish_reason) of one chunk."""
    choices = chunk.get("choices")
    if choices == [] and chunk.get("usage"):
        return "usage", "", None
    if not choices:
        return "other", "", None
    c = choices[0]
    fin = c.get("finish_reason")
    if chat:
        delta = c.get("delta") or {}
        content = delta.get("content") or ""
        if content:
            return "content", content, fin
        if "role" in delta:
            return "role", "", fin
    else:
        content = c.get("text") or ""
        if content:
            return "content", content, fin
    return ("finish" if fin else "other"), "", fin


def _http_error(code: int, raw: bytes) -> dict[str, Any]:
    try:
        err = json.loads(raw).get("error") or {}
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        err = {}
    return {"http_status": code, "type": str(err.get("code") or err.get("type") or "http_error"),
            "message": str(err.get("message") or raw[:300].decode("utf-8", "replace"))[:500]}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def _server_fields(ext: Any, status: str) -> tuple[dict | None, str | None, dict | None]:
    """(server block, why unavailable, reuse record) from the `flare` extension, as the
    server reported it; nothing is filled in."""
    if ext is None:
        why = ("cancelled before the final chunk" if status == "cancelled" else
               "the server sent no flare extension (server timings not supported)")
        return None, why, None
    # `"flare": [{...}, ...]` or `"flare": {"choices": [{...}, ...]}`: one entry per choice
    entries = ext.get("choices") if isinstance(ext, dict) and "choices" in ext else ext
    if isinstance(entries, list):
        entry = next((e for e in entries if isinstance(e, dict) and e.get("index") == 0),
                     entries[0] if entries else None)
    else:
        entry = entries
    if not isinstance(entry, dict):
        return None, f"unreadable flare extension: {str(ext)[:200]}", None
    reuse = entry.get("reuse")
    if not (isinstance(reuse, dict) and isinstance(reuse.get("outcome"), str)
            and isinstance(reuse.get("matched_tokens"), int)
            and isinstance(reuse.get("reused_tokens"), int)):
        reuse = None
    clock = entry.get("clock")
    timings = entry.get("timings")
    if clock != SERVER or not isinstance(timings, dict):
        return None, (f"flare extension with clock {clock!r} and timings "
                      f"{type(timings).__name__}: not recorded as server time"), reuse
    kept = {k: v for k, v in timings.items() if v is None or (isinstance(v, int)
                                                               and not isinstance(v, bool))}
    return ({"clock": SERVER, "request_id": str(entry.get("request_id")), "timings": kept},
            None, reuse)
