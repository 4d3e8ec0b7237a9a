"""An Anthropic Messages request as the chat `flare.server.chat` renders.

`chat_messages` turns a request into OpenAI-style messages: tool_use blocks become
assistant `tool_calls` with the input serialized as the forcing grammar writes it, so a
call the model made renders back into the same tokens and the prefix cache reuses them;
tool_result blocks become `tool` messages. A final assistant message of text only is a
prefill: the prompt ends with it and the reply continues it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare.server.anthropic.protocol import CountTokensRequest


@dataclass
class ChatPrompt:
    """A request as the chat renderer takes it.

    Attributes:
        messages: OpenAI-style message dicts (system, user, assistant with tool_calls,
            tool).
        tools: OpenAI-style tools to render, or None (no tools, or tool_choice none).
        prefill: text of a final assistant message that the reply continues ("" if none).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prefill: str = ""


def call_arguments(tool_input: Mapping[str, Any]) -> str:
    """A tool_use input as call arguments text: `json.dumps` with its default `", "` and
    `": "` separators and UTF-8 kept, the form the forcing grammar makes the model write."""
    return json.dumps(dict(tool_input), ensure_ascii=False)


def chat_messages(req: CountTokensRequest) -> ChatPrompt:
    """`req`'s system, messages and tools as OpenAI-style messages (module docstring).

    A user message's blocks keep their order: each tool_result is a `tool` message, each
    run of text blocks one user message. An assistant message's text blocks are joined
    with "\\n" into its content and its tool_use blocks become `tool_calls`.
    """
    out: list[dict[str, Any]] = []
    system = req.system_text
    if system is not None:
        out.append({"role": "system", "content": system})
    prefill = ""
    last = req.messages[-1]
    messages = req.messages
    if last.role == "assistant" and all(b.type == "text" for b in last.blocks):
        prefill = "\n".join(b.text for b in last.blocks)
        messages = messages[:-1]
    for m in messages:
        if m.role == "assistant":
            texts = [b.text for b in m.blocks if b.type == "text"]
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": call_arguments(b.input)}}
                     for b in m.blocks if b.type == "tool_use"]
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": "\n".join(texts) if texts or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        texts = []
        for b in m.blocks:
            if b.type == "text":
                texts.append(b.text)
                continue
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text})
        if texts or not m.blocks:
            out.append({"role": "user", "content": "\n".join(texts)})
    tools = [t.as_openai() for t in req.tools or ()] if req.tool_mode != "none" else None
    return ChatPrompt(out, tools or None, prefill)
