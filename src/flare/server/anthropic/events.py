"""Anthropic Messages responses: the message body and its server-sent events.

Wire format of a stream (Anthropic's): each event is `event: <type>\\ndata: <json>\\n\\n`:
`message_start` (the message with empty content and the prompt's usage), one `ping`, then
per content block `content_block_start`, `content_block_delta` (`text_delta`, or one
`input_json_delta` holding a tool call's whole input as `partial_json`) and
`content_block_stop`; then `message_delta` (`stop_reason`, `stop_sequence`, the final
usage) and `message_stop`. A failure once the stream has begun is an `error` event.

Text and calls come from the served format's `ToolCallParser` (the same parser, fed the
whole text, builds the non-streamed content), so a stream's blocks reassemble exactly into
the non-streamed message. A call is sent once complete and checked: its input arrives in
one delta.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from flare.server.tool_calls import ContentEvent, Event, ToolCall

StopReason = str  # "end_turn" | "max_tokens" | "stop_sequence" | "tool_use"


def sse(event: str, data: dict[str, Any]) -> str:
    """One event: `event: <type>\\ndata: <compact JSON, UTF-8 kept>\\n\\n`."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def tool_use_id(call: ToolCall) -> str:
    """Anthropic's id of a parsed call: `toolu_` and the call's own hex digits."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """`{"type": "tool_use", "id", "name", "input"}` of a parsed call."""
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
            "input": json.loads(call.arguments)}


def content_blocks(text: str, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Non-streamed content: a text block (when there is text), then a tool_use block per
    call."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return blocks + [tool_use_block(c) for c in calls]


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` counts the prompt tokens computed now,
    `cache_read_input_tokens` those reused from the prefix cache (the two add up to the
    prompt), `cache_creation_input_tokens` is 0 (nothing is billed for writing the cache)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str | None, has_calls: bool, matched_stop: str | None
                ) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason: "length" is
    max_tokens; a stop after calls is tool_use; a stop at a stop sequence is stop_sequence
    (naming it); any other stop is end_turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if matched_stop is not None:
        return "stop_sequence", matched_stop
    return "end_turn", None


def matched_stop(completion_text: str, stops: Sequence[str]) -> str | None:
    """Which stop sequence ended a completion whose whole decoded text (stop sequence
    included) is `completion_text`: the earliest one in it, as the engine cuts at the
    earliest; the first listed on a tie. None when none occurs."""
    best: tuple[int, int] | None = None
    for order, s in enumerate(stops):
        at = completion_text.find(s) if s else -1
        if at >= 0 and (best is None or at < best[0]):
            best = (at, order)
    return None if best is None else stops[best[1]]


def message(message_id: str, model: str, content: list[dict[str, Any]],
            reason: StopReason | None, stop_sequence: str | None,
            usage_: dict[str, int]) -> dict[str, Any]:
    """The message object (non-streamed body, or `message_start`'s with empty content)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": usage_}


class StreamEvents:
    """Builds the SSE events of one streamed message; `blocks` counts content blocks.

    Args:
        message_id: the "msg_..." id.
        model: the model name to report.
    """

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.blocks = 0
        self._open: str | None = None  # "text" while a text block is open

    def start(self, usage_: dict[str, int]) -> list[str]:
        """`message_start` (empty content, the prompt's usage) and a `ping`."""
        return [sse("message_start", {"type": "message_start", "message": message(
                    self.message_id, self.model, [], None, None, usage_)}),
                sse("ping", {"type": "ping"})]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        self.blocks += 1
        return [sse("content_block_stop", {"type": "content_block_stop",
                                           "index": self.blocks - 1})]

    def text(self, text: str) -> list[str]:
        """A text delta, opening a text block first when none is open."""
        if not text:
            return []
        out = []
        if self._open is None:
            self._open = "text"
            out.append(sse("content_block_start", {
                "type": "content_block_start", "index": self.blocks,
                "content_block": {"type": "text", "text": ""}}))
        out.append(sse("content_block_delta", {
            "type": "content_block_delta", "index": self.blocks,
            "delta": {"type": "text_delta", "text": text}}))
        return out

    def tool_use(self, call: ToolCall) -> list[str]:
        """A whole tool_use block: start (empty input), one input_json_delta, stop."""
        out = self._close()
        index = self.blocks
        out += [
            sse("content_block_start", {
                "type": "content_block_start", "index": index,
                "content_block": {"type": "tool_use", "id": tool_use_id(call),
                                  "name": call.name, "input": {}}}),
            sse("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
            sse("content_block_stop", {"type": "content_block_stop", "index": index}),
        ]
        self.blocks += 1
        return out

    def events(self, events: Sequence[Event]) -> list[str]:
        """SSE events for parser events (adjacent text merged into one delta)."""
        out: list[str] = []
        text = ""
        for ev in events:
            if isinstance(ev, ContentEvent):
                text += ev.text
                continue
            out += self.text(text)
            text = ""
            out += self.tool_use(ev.call)
        return out + self.text(text)

    def finish(self, reason: StopReason, stop_sequence: str | None,
               usage_: dict[str, int]) -> list[str]:
        """Close the open block, then `message_delta` (stop reason, final usage) and
        `message_stop`."""
        return self._close() + [
            sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": reason,
                                            "stop_sequence": stop_sequence},
                                  "usage": usage_}),
            sse("message_stop", {"type": "message_stop"}),
        ]

    @staticmethod
    def error(body: dict[str, Any]) -> str:
        """An `error` event with Anthropic's error body."""
        return sse("error", body)
