"""OpenAI's chat messages and function tools: what a conversation is made of on the OpenAI
surface, and the form the generation core renders (the Anthropic and Responses surfaces
convert their input to these).

Content is a string or a list of text parts (joined with "\\n"). An assistant message may
carry `tool_calls` (its content may then be null); a `tool` message answers one call and
needs its `tool_call_id`. Tools are functions only; names follow `check_tool_name` with
OpenAI's 64 characters.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from flare.server.request_rules import (
    OPENAI_TOOL_NAME_MAX,
    StrictRequest,
    check_schema,
    check_tool_name,
)


class TextContentPart(BaseModel):
    """`{"type": "text", "text": ...}`: the only content part Flare accepts."""

    type: Literal["text"]
    text: str


def _content_text(value: Any) -> Any:
    """Normalize message content: a string, or a list of text parts joined with "\\n".

    The newline join follows vLLM's rendering of text-only part lists.
    """
    if not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(
                f"content part {i} has type {kind!r}; only 'text' parts are supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content part {i} needs a string 'text'")  # noqa: TRY004 - pydantic reports ValueError only
        texts.append(text)
    return "\n".join(texts)


class FunctionCall(StrictRequest):
    """A call's function: name and arguments (JSON object text; an object is serialized)."""

    name: str
    arguments: str

    @field_validator("arguments", mode="before")
    @classmethod
    def _serialize_object(cls, v: Any) -> Any:
        return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v


class ToolCallMessage(StrictRequest):
    """One entry of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(StrictRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return check_tool_name(v, OPENAI_TOOL_NAME_MAX)

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_schema(v)
            if v.get("type", "object") != "object":
                raise ValueError(f"parameters must describe an object, not {v.get('type')!r}")
        return v


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: _FunctionName



class ChatMessage(StrictRequest):
    """One message of a conversation. `content` is normalized to a string (or None).

    An assistant message may carry `tool_calls` (its content may then be null); a `tool`
    message answers one call and needs its `tool_call_id`.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # validate_default: a missing content must reach the required-for-role check.
    content: str | None = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallMessage] | None = None

    _normalize_content = field_validator("content", mode="before")(_content_text)

    @field_validator("content")
    @classmethod
    def _content_required(cls, v: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if v is None and role not in (None, "assistant"):
            raise ValueError(f"content is required for a '{role}' message")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _assistant_only(cls, v: list[ToolCallMessage] | None, info: ValidationInfo):
        if v and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return v or None

    @model_validator(mode="after")
    def _tool_call_id_for_tool(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs the tool_call_id it answers")
        return self
