"""The tool-call parsers of the two formats Flare reads (policy: `flare.server.tool_calls`).

- `hermes` (Hermes, Qwen2/2.5/3 and Flare's fallback prompt):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call;
  text outside the blocks is content.
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole message is
  `{"name": "f", "parameters": {...}}` (optionally after `<|python_tag|>`), several calls
  separated by `;`. A message that does not start with `{` is plain content.
"""

from __future__ import annotations

from collections.abc import Iterable

from flare.server.json_object_scan import Malformed, ObjectScanner
from flare.server.tool_calls import ToolCall, ToolCallParser


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


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
