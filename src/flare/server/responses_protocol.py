"""OpenAI Responses API: the request schema and input items -> chat messages
(docs/agents.md, "Responses API").

Pure conversions, no engine: `flare.server.responses` serves them.

Input items (`input` as a string is one user message):
- `{"type": "message", "role": "user" | "assistant" | "system" | "developer", "content":
  str | [{"type": "input_text" | "output_text", "text"}]}` (`type` may be left out, as the
  SDK's "easy" input messages do); parts are joined with "\\n", as chat text parts are;
- `{"type": "function_call", "call_id", "name", "arguments"}`: a call of the assistant; it
  joins the assistant message right before it (the order a response's own output has),
  else starts an assistant message without content;
- `{"type": "function_call_output", "call_id", "output"}`: a `tool` message answering that
  call (which must be an earlier call of the conversation).
Any other item or content type is a 400 naming `input[i].type` or
`input[i].content[j].type`.

The response object and its stream events: `flare.server.responses_events`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, field_validator

from flare.server.api_error import ApiError, ParamError
from flare.server.openai.messages import FunctionDefinition
from flare.server.request_rules import StrictRequest, ToolRequest, check_schema, refused

RESPONSE_ID = r"resp_[0-9a-f]{32}"
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


# --------------------------------------------------------------------------- requests


class ResponseFunctionTool(FunctionDefinition):
    """A flat function tool: `{"type": "function", "name", "description", "parameters",
    "strict"}`."""

    type: Literal["function"]


class NamedFunctionChoice(StrictRequest):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: str


class TextFormat(StrictRequest):
    """`text.format`: plain text, any JSON object, or JSON valid for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_schema(v)
        return v


class TextConfig(StrictRequest):
    """`text`: its `format` (`verbosity` and other fields are accepted and ignored)."""

    format: TextFormat | None = None


class ResponsesRequest(ToolRequest):
    """POST /v1/responses body (fields Flare reads; others are ignored, as agents send
    many: `reasoning`, `include`, `truncation`, `prompt_cache_key`, `user`, ...).

    Refused: `background: true`, `conversation`, `prompt` (stored prompt templates):
    a 400 naming the field.
    """

    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    _no_background = refused("background", message=(
        "background responses are not supported; leave it false"))
    _unsupported = refused("conversation", "prompt", when=lambda v: v is not None, message=(
        "not supported by this server; send input (and previous_response_id) instead"))

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        for i, tool in enumerate(v if isinstance(v, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ParamError(f"tools[{i}].type", f"tool type {kind!r} is not supported; "
                                 f"this server runs function tools only")
        return v

    # tool checks, `tool_mode` and `forced_tool_name`: `ToolRequest`'s
    named_choice = NamedFunctionChoice

    @staticmethod
    def tool_name(tool: ResponseFunctionTool) -> str:
        return tool.name

    @staticmethod
    def choice_name(choice: NamedFunctionChoice) -> str:
        return choice.name

    @property
    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema `text.format` asks for (json_object: any object), or None."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "object"}
        return fmt.schema_ or {}

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in chat's nested shape (what the chat renderer reads), or None when
        they are not used (`tool_choice: "none"` or no tools)."""
        if self.tool_mode == "none":
            return None
        return [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                exclude_none=True)}
                for t in self.tools or ()]

    def echo_tools(self) -> list[dict[str, Any]]:
        """The tools as the response object repeats them."""
        return [{"type": "function", "name": t.name, "description": t.description,
                 "parameters": t.parameters, "strict": t.strict} for t in self.tools or ()]

    def echo_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, NamedFunctionChoice):
            return {"type": "function", "name": self.tool_choice.name}
        return self.tool_choice or "auto"

    def echo_text(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return {"format": {"type": "text"}}
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def responses_param(chat_param: str | None) -> str | None:
    """A chat parameter name (from the grammar) as the Responses request names it."""
    if chat_param is None:
        return None
    if chat_param == "response_format":
        return "text.format"
    return chat_param.replace(".function.parameters", ".parameters")


# --------------------------------------------------------------------------- input items


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined with "\\n"."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"Invalid type for '{where}': expected a string or a list of "
                            f"text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ApiError(400, f"Invalid value for '{where}[{j}].type': {kind!r}; only "
                                f"input_text and output_text parts are supported",
                           param=f"{where}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"Missing required parameter: '{where}[{j}].text'.",
                           param=f"{where}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        kind = "Missing required parameter" if value is None else "Invalid type for"
        raise ApiError(400, f"{kind}: '{where}.{key}' (a string).", param=f"{where}.{key}")
    return value


def input_messages(input: str | Sequence[Any], *, known_calls: Sequence[str] = ()
                   ) -> tuple[list[dict[str, Any]], list[int]]:
    """Chat messages (plain dicts, chat's shape) for Responses input items (module
    docstring).

    Args:
        input: the request's `input`.
        known_calls: call ids of the conversation before these items (a continued
            response's history), which a function_call_output may answer too.

    Returns:
        (messages, origin): `origin[k]` is the index of the item message k comes from.

    Raises:
        ApiError: 400 naming the item field at fault.
    """
    if isinstance(input, str):
        return [{"role": "user", "content": input}], [0]
    messages: list[dict[str, Any]] = []
    origin: list[int] = []
    calls = set(known_calls)
    last_assistant = -2  # item index of the item that made the last assistant message
    for i, item in enumerate(input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"Invalid type for '{where}': expected an object.", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise ApiError(400, f"Invalid value for '{where}.role': {role!r}; expected "
                                    f"one of {', '.join(MESSAGE_ROLES)}", param=f"{where}.role")
            if "content" not in item:
                raise ApiError(400, f"Missing required parameter: '{where}.content'.",
                               param=f"{where}.content")
            messages.append({"role": role, "content": _text_of(item["content"],
                                                                 f"{where}.content")})
            origin.append(i)
            if role == "assistant":
                last_assistant = i
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where),
                                 "arguments": _arguments(item.get("arguments"), where)}}
            calls.add(call["id"])
            if last_assistant == i - 1 and messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origin.append(i)
            last_assistant = i
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            if call_id not in calls:
                raise ApiError(400, f"Invalid value for '{where}.call_id': {call_id!r} "
                                    f"answers no earlier function_call of the conversation",
                               param=f"{where}.call_id")
            output = item.get("output")
            if output is None:
                raise ApiError(400, f"Missing required parameter: '{where}.output'.",
                               param=f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(output, f"{where}.output")})
            origin.append(i)
        else:
            raise ApiError(400, f"Invalid value for '{where}.type': {kind!r}; this server "
                                f"accepts message, function_call and function_call_output "
                                f"items", param=f"{where}.type")
    if not messages:
        raise ApiError(400, "input has no items.", param="input")
    return messages, origin


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise ApiError(400, f"Invalid type for '{where}.arguments': expected a JSON string.",
                       param=f"{where}.arguments")
    return value


def call_ids(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Ids of every tool call in chat messages."""
    return [c["id"] for m in messages for c in m.get("tool_calls") or ()]


def output_messages(output: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages the conversation continues with."""
    messages, _ = input_messages(list(output)) if output else ([], [])
    return messages
