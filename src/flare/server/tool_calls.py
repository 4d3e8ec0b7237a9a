"""Tool calls: what a parsed call is, and the policy every tool-call parser keeps.

The parsers of the two formats (`hermes`, `llama3_json`) are in
`flare.server.tool_parsers`; the formats themselves, with their fallback prompts and
forcing grammars, are in `flare.server.tool_formats` (`flare serve --tool-parser`).

`ToolCallParser.push(text)` reads model text as it streams and returns events: content to
send, or a complete call (`ToolCallEvent`). Policy, identical for streamed and non-streamed
responses (the non-streamed parse is the same parser fed the whole text at once, so a
stream's deltas always reassemble into the non-streamed message):

- Markup is held back while it may still be a tool call; no `<tool_call>` of a well-formed
  call ever reaches content.
- A call is emitted once its JSON object is complete and valid (a string-aware scanner
  finds its end, so braces and quotes inside strings such as `mkdir -p a/{b,c}` are text),
  its name is one of the request's tools, and its arguments are a JSON object. Arguments are
  re-serialized with `json.dumps(..., ensure_ascii=False)` (`", "` and `": "`
  separators), the same form the forcing grammar makes the model write.
- Malformed output (broken JSON, an unknown tool name, markup inside the JSON, an
  unterminated call at the end) is returned as content, raw, never as a half-parsed call.
- Whitespace between content and calls, or between calls, is dropped; a message without
  calls keeps its text byte for byte.
- With `max_calls` (parallel_tool_calls false: 1), calls after the first `max_calls` are
  dropped.
- `strict` (a forced answer: tool_choice required / any / a named tool, written under the
  forcing grammar, `flare.server.grammar`): the text can only be calls, so what is left
  unfinished at the end (a call cut by the token limit) is dropped, never content, and
  `dropped` says so. `settled_reason` then reports an answer cut after at least one
  complete call as ended by those calls.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object serialized as text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A complete call; `index` counts the calls of this message from 0."""

    index: int
    call: ToolCall


Event = ContentEvent | ToolCallEvent


@dataclass
class ParsedMessage:
    """What a whole completion parses into; `strict` as the parser's (module docstring)."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    strict: bool = False

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`settled_reason` of this message."""
        return settled_reason(engine_reason, len(self.tool_calls), self.strict)


def settled_reason(engine_reason: str | None, num_calls: int, strict: bool) -> str | None:
    """The engine's finish reason as an answer reports it.

    A strict (forced) answer that the token limit cut after `num_calls` >= 1 complete calls
    ended with those calls: "stop" (which each surface reports as its tool-call reason:
    OpenAI `tool_calls`, Anthropic `tool_use`, a completed response); its unfinished call
    was dropped (`ToolCallParser.dropped`). Anything else is returned unchanged: a forced
    call cut before it was complete stays "length".
    """
    if strict and num_calls > 0 and engine_reason == "length":
        return "stop"
    return engine_reason


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(value: Any) -> str | None:
    """Arguments as JSON object text, or None when they are not an object."""
    if value is None:
        value = {}
    if isinstance(value, str):  # some models double-encode the arguments
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


class ToolCallParser:
    """Base of the streaming parsers: content bookkeeping and call emission.

    Args:
        tool_names: names a call may use; None accepts any name.
        max_calls: most calls to emit; later ones are dropped.
    """

    def __init__(self, tool_names: Iterable[str] | None = None,
                 max_calls: int | None = None, strict: bool = False) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.max_calls = max_calls
        self.strict = strict
        self.dropped = ""  # strict: the unfinished text dropped at the end
        self.num_calls = 0
        self._buf = ""
        self._events: list[Event] = []
        self._pending_ws = ""
        self._strip_leading = False
        self._finished = False

    def push(self, text: str) -> list[Event]:
        """Read more model text; returns the events it completes."""
        if self._finished:
            raise RuntimeError("push after finish")
        self._buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The text has ended: resolve everything held back (calls or content; strict:
        an unfinished call is dropped)."""
        self._finished = True
        if self.strict:
            self._step(final=False)  # every complete call is out
            self._drop_unfinished()
        else:
            self._step(final=True)
        if self.num_calls == 0 and self._pending_ws and not self.strict:
            self._events.append(ContentEvent(self._pending_ws))
        self._pending_ws = ""
        return self._take()

    def parse(self, text: str) -> ParsedMessage:
        """The whole completion at once (what a non-streamed response returns)."""
        out = collect(self.push(text) + self.finish())
        out.strict = self.strict
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`settled_reason` of what this parser has read (call after `finish`)."""
        return settled_reason(engine_reason, self.num_calls, self.strict)

    # -- helpers for subclasses -------------------------------------------------------

    def _step(self, final: bool) -> None:
        raise NotImplementedError

    def _drop_unfinished(self) -> None:
        """Strict end: a call whose JSON object is complete is kept (its closing markup
        may be cut); anything else left is the start of a call the limit cut: dropped."""
        pending = getattr(self, "_pending", None)
        if pending is not None:
            self._emit_call(pending)
            self._pending = None
        self.dropped = self._buf
        self._buf = ""

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        """Queue content; whitespace that may border a call is held until it is known not
        to (and dropped if a call follows)."""
        if not text:
            return
        text = self._pending_ws + text
        if self._strip_leading:
            text = text.lstrip()
        keep = len(text.rstrip())
        if keep:
            self._events.append(ContentEvent(text[:keep]))
            self._strip_leading = False
        self._pending_ws = text[keep:]

    def _call(self, obj_text: str, args_keys: Sequence[str]) -> ToolCall | None:
        """A call from one JSON object's text, or None when it is not a valid call."""
        try:
            obj = json.loads(obj_text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name = obj["name"]
        if self.tool_names is not None and name not in self.tool_names:
            return None
        key = next((k for k in args_keys if k in obj), None)
        arguments = _arguments_text(obj.get(key) if key else None)
        if arguments is None:
            return None
        return ToolCall(new_call_id(), name, arguments)

    def _emit_call(self, call: ToolCall) -> None:
        self._pending_ws = ""
        self._strip_leading = True
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return
        self._events.append(ToolCallEvent(self.num_calls, call))
        self.num_calls += 1


def collect(events: Iterable[Event]) -> ParsedMessage:
    """Fold events into a message (content joined, calls in order)."""
    out = ParsedMessage()
    parts = []
    for ev in events:
        if isinstance(ev, ContentEvent):
            parts.append(ev.text)
        else:
            out.tool_calls.append(ev.call)
    out.content = "".join(parts)
    return out
