"""One Anthropic Messages reply through the official SDK, streamed or not, for the tests
that check both ways give the same message."""

from __future__ import annotations

from typing import Any


def anthropic_message(client, stream: bool, **kw: Any):
    """The final `anthropic.types.Message` of `client.messages.create(**kw)`, or of
    `client.messages.stream(**kw)` (the SDK assembles the streamed events) when `stream`."""
    if stream:
        with client.messages.stream(**kw) as s:
            return s.get_final_message()
    return client.messages.create(**kw)


def text_and_tool_uses(message) -> tuple[str, list]:
    """(the text blocks joined, the tool_use blocks in order) of a Message."""
    return ("".join(b.text for b in message.content if b.type == "text"),
            [b for b in message.content if b.type == "tool_use"])
