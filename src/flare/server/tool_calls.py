"""Tool-call parsers: how Flare reads a model's calls back, streamed or not.

Two formats, chosen per model family at serve time (`flare serve --tool-parser`; the
formats themselves, with their fallback prompts and forcing grammars, are in
`flare.server.tool_formats`):

- `hermes` (Hermes, Qwen2/2.5/3 and Flare's fallback prompt):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call;
  text outside the blocks is content.
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole message is
  `{"name": "f", "parameters": {...}}` (optionally after `<|python_tag|>`), several calls
  separated by `;`. A message that does not start with `{` is plain content.

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

from flare.server.json_object_scan import Malformed, ObjectScanner


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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


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


# --------------------------------------------------------------------------- parsers


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


class HermesParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` blocks inside free text (module docstring)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Iterable[str] | None = None,
                 max_calls: int | None = None, strict: bool = False) -> None:
        super().__init__(tool_names, max_calls, strict)
        self._state = "text"  # text | call | after
        self._scanner = ObjectScanner()
        self._scanned = 0
        self._obj_end = 0
        self._pending: ToolCall | None = None

    def _reject(self) -> None:
        # the opening tag did not start a valid call: it is plain text
        self._content(self.OPEN)
        self._buf = self._buf[len(self.OPEN):]
        self._state = "text"
        self._pending = None

    def _step(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "text":
                k = buf.find(self.OPEN)
                if k >= 0:
                    self._content(buf[:k])
                    self._buf = buf[k:]
                    self._state, self._scanner = "call", ObjectScanner()
                    self._scanned = len(self.OPEN)
                    continue
                cut = len(buf) - (0 if final else _partial_suffix(buf, self.OPEN))
                self._content(buf[:cut])
                self._buf = buf[cut:]
                return
            if self._state == "call":
                try:
                    end = self._scanner.feed(buf, self._scanned)
                except Malformed:
                    self._reject()
                    continue
                if end is None:
                    if final:
                        self._reject()
                        continue
                    self._scanned = len(buf)
                    return
                self._pending = self._call(buf[len(self.OPEN):end], ("arguments", "parameters"))
                if self._pending is None:
                    self._reject()
                    continue
                self._state, self._obj_end = "after", end
                continue
            # after: the object is complete; expect the closing tag (or the next call)
            rest = buf[self._obj_end:].lstrip()
            for tag in (self.CLOSE, self.OPEN):
                if rest.startswith(tag):
                    self._accept(rest[len(tag):] if tag == self.CLOSE else rest)
                    break
            else:
                if final and self.CLOSE.startswith(rest):  # tolerate a missing/cut close
                    self._accept("")
                    continue
                if not final and (self.CLOSE.startswith(rest) or self.OPEN.startswith(rest)):
                    return
                self._reject()

    def _accept(self, rest: str) -> None:
        assert self._pending is not None
        self._emit_call(self._pending)
        self._pending, self._buf, self._state = None, rest, "text"


class Llama3JsonParser(ToolCallParser):
    """A message that is `{"name": ..., "parameters": {...}}` calls, `;`-separated."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tool_names: Iterable[str] | None = None,
                 max_calls: int | None = None, strict: bool = False) -> None:
        super().__init__(tool_names, max_calls, strict)
        self._state = "start"  # start | text | calls | after | next
        self._scanner = ObjectScanner()
        self._scanned = 0
        self._pending: ToolCall | None = None

    def _as_text(self) -> None:
        self._content(self._buf)
        self._buf, self._state = "", "text"

    def _step(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "text":
                self._as_text()
                return
            if self._state == "start":
                head = buf.lstrip()
                if head.startswith(self.PYTHON_TAG):
                    head = head[len(self.PYTHON_TAG):].lstrip()
                elif not final and self.PYTHON_TAG.startswith(head):
                    return  # whitespace or a partial tag so far
                if head.startswith("{"):
                    self._buf, self._state = head, "calls"
                    self._scanner, self._scanned = ObjectScanner(), 0
                elif not head and not final:
                    return
                else:
                    self._state = "text"  # not a call: the raw text is content
                continue
            if self._state == "calls":
                try:
                    end = self._scanner.feed(buf, self._scanned)
                except Malformed:
                    end = -1
                if end is None and not final:
                    self._scanned = len(buf)
                    return
                call = None if end in (None, -1) else self._call(buf[:end],
                                                                  ("parameters", "arguments"))
                if call is None:
                    self._as_text()  # the rest of the message is content, raw
                    return
                self._pending, self._buf, self._state = call, buf[end:], "after"
                continue
            if self._state == "next":  # after a `;`: another object, or the end
                head = buf.lstrip()
                if not head:
                    if final:
                        self._buf, self._state = "", "text"
                        continue
                    return
                self._buf = head
                if head.startswith("{"):
                    self._state, self._scanner, self._scanned = "calls", ObjectScanner(), 0
                else:
                    self._state = "text"  # words after the calls are content
                continue
            # after one complete call: `;` or another object, or the end
            rest = buf.lstrip()
            if not rest and not final:
                return
            assert self._pending is not None
            self._emit_call(self._pending)
            self._pending = None
            if rest.startswith(";"):
                self._buf, self._state = rest[1:], "next"
            else:
                self._buf, self._state = rest, "next" if rest.startswith("{") else "text"


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
