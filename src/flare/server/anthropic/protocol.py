"""Anthropic Messages API requests: schemas, checks, and their conversion to a chat.

`MessagesRequest` (POST /v1/messages) and `CountTokensRequest` (POST
/v1/messages/count_tokens) validate what Flare supports and refuse the rest with a 400 that
names the field (`validation_message`):

- `system`: a string or text blocks (joined with "\\n").
- `messages[].content`: a string or blocks of type `text`, `tool_use` (assistant
  messages) and `tool_result` (user messages; `content` a string or text blocks,
  `is_error`). Any other block (`image`, `document`, `thinking`, ...) is refused, by name.
  A `tool_result` must answer a `tool_use` of an earlier assistant message.
- `tools`: custom tools (`name`, `description`, `input_schema`, a JSON Schema of an
  object); server tools (`type: "web_search_..."`, ...) are refused.
- `tool_choice`: `auto`, `any`, `tool` (with `name`, among `tools`), `none`, and
  `disable_parallel_tool_use`.
- `max_tokens` (required on /v1/messages), `stop_sequences`, `temperature` (0-1),
  `top_p`, `top_k`, `stream`; `metadata`, `thinking`, `cache_control` and other fields
  are accepted and ignored.

`flare.server.anthropic.chat_prompt` turns a validated request into the chat the renderer
takes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from flare.runtime.request import SamplingParams
from flare.server.api_error import messages_at
from flare.server.request_rules import (
    ANTHROPIC_TOOL_NAME_MAX,
    check_distinct_tool_names,
    check_schema,
    check_tool_name,
)

BLOCK_TYPES = ("text", "tool_use", "tool_result")


class _Model(BaseModel):
    # strict as the OpenAI surface: no coercion of "5" to 5; unknown fields ignored
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Model):
    """`{"type": "text", "text": ...}` (`cache_control`, `citations` ignored)."""

    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    """An assistant's call: `{"type": "tool_use", "id", "name", "input": {...}}`."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    """A tool's answer: `{"type": "tool_result", "tool_use_id", "content", "is_error"}`."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        _check_block_types(v, ("text",), "a tool_result's content")
        return v

    @property
    def text(self) -> str:
        """The result as text (text blocks joined with "\\n"); an error is marked."""
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


def _check_block_types(value: Any, allowed: Sequence[str], where: str) -> None:
    """Refuse blocks of a type Flare does not serve, naming it (before pydantic's generic
    union error could)."""
    if not isinstance(value, list):
        return
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise ValueError(
                f"content block {i} has type {kind!r}, which this server does not support in "
                f"{where} (supported: {', '.join(allowed)})")


class Message(_Model):
    """One turn: `role` user or assistant, `content` a string or blocks."""

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, v: Any) -> Any:
        _check_block_types(v, BLOCK_TYPES, "messages")
        return v

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> "Message":
        if isinstance(self.content, list):
            wrong = "tool_result" if self.role == "assistant" else "tool_use"
            if any(b.type == wrong for b in self.content):
                owner = "user" if wrong == "tool_result" else "assistant"
                raise ValueError(f"{wrong} blocks belong in {owner} messages, not "
                                 f"{self.role} messages")
        return self

    @property
    def blocks(self) -> list[Any]:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class ToolDefinition(_Model):
    """A custom tool: `name`, `description`, `input_schema` (JSON Schema of an object)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None  # False: arguments may hold properties the schema lacks

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") not in (None, "custom"):
            raise ValueError(f"tool type {v.get('type')!r} is not supported; this server "
                             "runs custom tools only (name, description, input_schema)")
        return v

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return check_tool_name(v, ANTHROPIC_TOOL_NAME_MAX, "tool name")

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_schema(v)
        if v.get("type", "object") != "object":
            raise ValueError(f"input_schema must describe an object, not {v.get('type')!r}")
        return v

    def as_openai(self) -> dict[str, Any]:
        """The tool as the chat renderer takes it (OpenAI's function shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema
        return {"type": "function", "function": function}


class ToolChoice(_Model):
    """`{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        if self.type != "tool" and self.name is not None:
            raise ValueError(f"tool_choice of type {self.type!r} takes no name")
        return self


class CountTokensRequest(_Model):
    """POST /v1/messages/count_tokens body: the prompt part of a messages request."""

    model: str
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, v: list[Message]) -> list[Message]:
        calls: set[str] = set()
        for i, m in enumerate(v):
            for b in m.blocks:
                if b.type == "tool_use":
                    calls.add(b.id)
                elif b.type == "tool_result" and b.tool_use_id not in calls:
                    raise ValueError(
                        f"message {i} has a tool_result for tool_use_id {b.tool_use_id!r}, "
                        "which no earlier assistant message's tool_use has")
        return v

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        check_distinct_tool_names([t.name for t in v or ()])
        return v or None

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v: ToolChoice | None, info: ValidationInfo
                            ) -> ToolChoice | None:
        names = [t.name for t in info.data.get("tools") or ()]
        if v is not None and v.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {v.type!r} needs tools")
        if v is not None and v.type == "tool" and v.name not in names:
            raise ValueError(f"tool_choice names tool {v.name!r}, which is not in tools "
                             f"({', '.join(names)})")
        return v

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """The shared core's tool mode: `any` is "required", `tool` is "named"."""
        choice = self.tool_choice.type if self.tool_choice else "auto"
        if not self.tools or choice == "none":
            return "none"
        return {"auto": "auto", "any": "required", "tool": "named"}[choice]

    @property
    def parallel(self) -> bool:
        """Whether one answer may hold several calls (`disable_parallel_tool_use`)."""
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)

    @property
    def system_text(self) -> str | None:
        """`system` as one string (text blocks joined with "\\n"), None without one."""
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)

    def text_length(self) -> int:
        """Characters of every text in the prompt (for the prompt bound)."""
        total = len(self.system_text or "")
        for m in self.messages:
            for b in m.blocks:
                if b.type == "text":
                    total += len(b.text)
                elif b.type == "tool_result":
                    total += len(b.text)
                else:
                    total += len(json.dumps(b.input, ensure_ascii=False))
        return total


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages body."""

    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine sampling parameters (Anthropic's default temperature is 1)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=tuple(self.stop_sequences or ()),
        )


# --------------------------------------------------------------------------- validation


def _loc(loc: Sequence[Any]) -> str:
    """("body", "messages", 0, "content", 1) -> "messages.0.content.1" (Anthropic's
    notation), without pydantic's union branch names."""
    parts: list[str] = []
    previous: Any = None
    for part in loc:
        skip = (part == "body" and not parts) or (isinstance(part, str) and (
            "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"}
            or (part in BLOCK_TYPES and isinstance(previous, int))))  # a union's tag
        previous = part
        if not skip:
            parts.append(str(part))
    return ".".join(parts)


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    """One message for FastAPI/pydantic validation errors: `<field>: <problem>` for the
    first failing field (all branches of a failed union joined with " or "); a missing
    field reads "<field>: Field required", as Anthropic writes it."""
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return f"invalid JSON body: {detail}"
    top = tuple(first.get("loc", ()))[:2]
    # a union fails in every branch: report the branch that got furthest (a block's field
    # rather than "not a string")
    first = max((e for e in errors if tuple(e.get("loc", ()))[:2] == top),
                key=lambda e: len(_loc(e.get("loc", ())).split(".")), default=first)
    where = _loc(first.get("loc", ()))
    text = messages_at(errors, where, _loc)
    return f"{where}: {text}" if where else text
