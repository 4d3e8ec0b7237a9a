"""OpenAI Responses API: the response object and its stream events, built from the tool
call parser's events (docs/agents.md, "Responses API").

Stream events (`ResponseEvents`): `response.created`, `response.in_progress`, then per
output item `response.output_item.added`, for a message `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, for a call `response.function_call_arguments.delta`,
`response.function_call_arguments.done`, then `response.output_item.done`; last
`response.completed` (or `response.incomplete` when the output was cut by
`max_output_tokens` or the context, as OpenAI does). Each event carries its
`sequence_number`; on the wire it is `event: <type>\\ndata: <json>\\n\\n`. The non-streamed
output is built by the same machine, so a stream reassembles into it exactly.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from flare.server.tool_calls import ContentEvent, Event, ToolCall


def new_item_id(prefix: str) -> str:
    """An output item id: `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The Responses `usage` object."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def sse_bytes(event: dict[str, Any]) -> str:
    """One Responses SSE event: `event: <type>\\ndata: <compact JSON>\\n\\n`."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


class ResponseEvents:
    """Builds a response's output items and its stream events from parser events.

    Args:
        response: the response object so far (status "in_progress", `output` empty); it is
            copied into the lifecycle events and completed by `finish`.
    """

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._open: int | None = None  # output index of the message being written

    def _event(self, type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": json.loads(json.dumps(self.output))}

    def start(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`."""
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def push(self, events: Sequence[Event]) -> list[dict[str, Any]]:
        """Stream events for parser events (content text, complete calls)."""
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ContentEvent):
                if ev.text:
                    out += self._text(ev.text)
            else:
                out += self._call(ev.call)
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        self._open = len(self.output)
        item = {"type": "message", "id": new_item_id("msg"), "status": "in_progress",
                "role": "assistant", "content": []}
        self.output.append(item)
        out = [self._event("response.output_item.added", output_index=self._open,
                           item=json.loads(json.dumps(item)))]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        out.append(self._event("response.content_part.added", item_id=item["id"],
                               output_index=self._open, content_index=0, part=dict(part)))
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = self._open_message() if self._open is None else []
        item = self.output[self._open]
        item["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=item["id"],
                               output_index=self._open, content_index=0, delta=text,
                               logprobs=[]))
        return out

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.output[index]
        part = item["content"][0]
        item["status"] = status
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=dict(part)),
            self._event("response.output_item.done", output_index=index,
                        item=json.loads(json.dumps(item))),
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        out = self._close_message("completed")
        index = len(self.output)
        item = {"type": "function_call", "id": new_item_id("fc"), "call_id": call.id,
                "name": call.name, "arguments": "", "status": "in_progress"}
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=index,
                               item=dict(item)))
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=index, delta=call.arguments))
        item.update(arguments=call.arguments, status="completed")
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, name=call.name, arguments=call.arguments))
        out.append(self._event("response.output_item.done", output_index=index,
                               item=dict(item)))
        return out

    def finish(self, incomplete: bool, usage: dict[str, Any],
               extra: dict[str, Any] | None = None,
               error: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Close the open message and end the response: `response.completed`;
        `response.incomplete` (reason `max_output_tokens`) when `incomplete`; or, given an
        `error` ({"code", "message"}), `response.failed` with the output so far (its
        message closed as incomplete). A response with no output at all gets an empty
        message, as OpenAI's does."""
        out: list[dict[str, Any]] = []
        if not self.output:
            out += self._open_message()
        status = "failed" if error else "incomplete" if incomplete else "completed"
        out += self._close_message("completed" if status == "completed" else "incomplete")
        self.response.update(
            status=status, usage=usage, error=error,
            incomplete_details=({"reason": "max_output_tokens"}
                                if status == "incomplete" else None),
            **(extra or {}))
        self.response["output"] = self.output
        out.append(self._event(f"response.{status}", response=self._snapshot()))
        return out

    def fail(self, message: str, code: str = "server_error") -> list[dict[str, Any]]:
        """`response.failed`: the engine failed the request after the stream began."""
        self.response.update(status="failed", error={"code": code, "message": message})
        return [self._event("response.failed", response=self._snapshot())]
