"""OpenAI-compatible request and response schemas for /v1/chat/completions and /v1/completions.

Requests are validated here (types, ranges, parameters Flare does not support); anything that
fails becomes an HTTP 400 with OpenAI's error body `{"error": {message, type, param, code}}`
naming the parameter. Unknown extra fields are ignored, as agent clients send many.

Types are strict, as OpenAI's API is: a value of the wrong JSON type (`"max_tokens": "5"`,
`"temperature": "hot"`, `"stream": "yes"`, `"n": 2.0`) is a 400, never coerced. The one
conversion kept is an integer where a number is expected (`"temperature": 1`). Numbers must
be finite (the JSON parser would accept NaN and Infinity).

Extensions over OpenAI: `top_k` (0 or -1 disables), `ignore_eos` and `repetition_penalty`
(vLLM's) in requests; the `flare` object in responses (docs/api-extensions.md). Limits that
depend on the served package or settings (n, context length, model name) are checked by the
app. Logprobs and penalties: docs/api-extensions.md.

Tool calling (docs/agents.md): `tools` (functions only), `tool_choice` ("none", "auto",
"required" or `{"type": "function", "function": {"name": ...}}`), `parallel_tool_calls`,
assistant messages with `tool_calls` (content may be null) and `tool` messages with
`tool_call_id`, which must name a call of an earlier assistant message (else 400 on
`messages[i].tool_call_id`, as OpenAI answers). `response_format`: text, json_object,
json_schema. The deprecated `functions` / `function_call` are refused with a 400 that says
to use `tools`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from flare.runtime.request import SamplingParams
from flare.state.sessions import SessionError, check_name

MAX_STOP_SEQUENCES = 4


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered to the client with OpenAI's error body.

    Args:
        status_code: HTTP status (400 invalid request, 404 unknown model, 500 server fault).
        message: human-readable; names the offending value and the limit where there is one.
        type: OpenAI error type ("invalid_request_error", "server_error", ...).
        param: the request parameter at fault, e.g. "messages[2].content", or None.
        code: machine-readable code, e.g. "context_length_exceeded", or None.
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ParamError(ValueError):
    """A validator's error about a parameter other than the field it validates.

    Raised inside a pydantic validator; `validation_error` reports `param` (relative to the
    request body, e.g. "messages[3].tool_call_id") instead of the validated field, and
    `code` (e.g. "invalid_session_name") as the error's code.
    """

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _format_loc(loc: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str):
            # Pydantic names the union branch it tried ("str", "list[int]",
            # "function-after[...]"); those are not request parameters.
            if "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"}:
                continue
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """Turn pydantic/FastAPI validation errors into one 400 `ApiError` naming the parameter.

    The first failing parameter is reported; when it failed every branch of a union, the
    branches' messages are joined with " or ". A value of the wrong JSON type is "Invalid
    type for '<param>'", as OpenAI words it; a `ParamError` names its own parameter.
    """
    if not errors:
        return ApiError(400, "Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return ApiError(400, f"Invalid JSON body: {detail}", code="invalid_json")
    param = _format_loc(first.get("loc", ()))
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return ApiError(400, f"Invalid value for '{cause.param}': {cause}", param=cause.param,
                        code=cause.code)
    msgs: list[str] = []
    for err in errors:
        if _format_loc(err.get("loc", ())) != param:
            continue
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if msg not in msgs:
            msgs.append(msg)
    message = " or ".join(msgs)
    if param is None:
        return ApiError(400, f"Invalid request body: {message}")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param)
    if str(first.get("type", "")).endswith("_type"):  # int_type, bool_type, string_type...
        return ApiError(400, f"Invalid type for '{param}': {message}", param=param)
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param)


# --------------------------------------------------------------------------- requests


class _Request(BaseModel):
    # strict: no coercion of "5" to 5 or "yes" to True (module docstring)
    model_config = ConfigDict(extra="ignore", strict=True)


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
            raise ValueError(f"content part {i} needs a string 'text'")
        texts.append(text)
    return "\n".join(texts)


_TOOL_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]+")
OPENAI_TOOL_NAME_MAX = 64  # OpenAI's function names (chat and Responses)
ANTHROPIC_TOOL_NAME_MAX = 128  # Anthropic's tool names


def check_tool_name(name: str, max_length: int, what: str = "function name") -> str:
    """Return `name` if it is a valid tool name: 1 to `max_length` characters of a-z, A-Z,
    0-9, `_` and `-` (the rule of every surface; the length is the surface's: OpenAI 64,
    Anthropic 128).

    Raises:
        ValueError: naming the value and the rule (`what` names the field in the message).
    """
    if len(name) > max_length or not _TOOL_NAME_CHARS.fullmatch(name):
        raise ValueError(f"{what} {name!r} must be 1-{max_length} characters of a-z, A-Z, "
                         "0-9, _ and -")
    return name


class FunctionCall(_Request):
    """A call's function: name and arguments (JSON object text; an object is serialized)."""

    name: str
    arguments: str

    @field_validator("arguments", mode="before")
    @classmethod
    def _serialize_object(cls, v: Any) -> Any:
        return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v


class ToolCallMessage(_Request):
    """One entry of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
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
            _check_schema(v)
            if v.get("type", "object") != "object":
                raise ValueError(f"parameters must describe an object, not {v.get('type')!r}")
        return v


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: _FunctionName


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_schema(v)
        return v


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _only_for_json_schema(cls, v: JsonSchemaFormat | None, info: ValidationInfo):
        if v is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema is only allowed with type 'json_schema'")
        return v

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


def check_distinct_tool_names(names: Sequence[str]) -> None:
    """Refuse a tool list that names one tool twice (every API surface's rule).

    Raises:
        ValueError: naming the first repeated name.
    """
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"two tools are named {dup!r}; names must be distinct")


def _check_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError unless `schema` is a valid JSON Schema (any draft's meta-schema)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError:
        raise ValueError("JSON schema is nested too deeply") from None
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ValueError(f"not a valid JSON schema{f' at {where}' if where else ''}: "
                         f"{e.message}") from None


class ChatMessage(_Request):
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
    def _tool_call_id_for_tool(self) -> "ChatMessage":
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs the tool_call_id it answers")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions, in validation order."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1)
    # int64, as OpenAI documents it; choice i uses seed + i, which torch still accepts
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    session: str | None = None  # extension: a session name (docs/api-extensions.md)

    @field_validator("session")
    @classmethod
    def _session_name(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_name(v)
            except SessionError as e:
                raise ParamError("session", str(e), code="invalid_session_name") from None
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids_and_range(cls, v: dict[str, float] | None
                                  ) -> dict[str, float] | None:
        """Keys are token ids written as decimal strings, values in [-100, 100] (OpenAI's
        rules); the app checks the ids against the vocabulary."""
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdecimal():
                raise ValueError(f"logit_bias keys must be token ids (decimal strings), "
                                 f"got {key!r}")
            if not -100 <= bias <= 100:  # also refuses NaN and infinities
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} "
                                 f"for token {key}")
        return v

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs in token order."""
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))

    @property
    def stop_list(self) -> tuple[str, ...]:
        """Stop strings as a tuple (a single string becomes one stop)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        """Completion tokens the client asked for, None when it did not say."""
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine reports (`SamplingParams.logprobs`); None:
        no logprobs."""
        return None

    def sampling_params(self, max_tokens: int, choice_index: int = 0) -> SamplingParams:
        """Engine sampling parameters for one choice.

        Args:
            max_tokens: completion budget after the app's clamping to the context length.
            choice_index: with a seed s, choice i samples with seed s + i, so the n choices
                differ yet each is reproducible.
        """
        top_k = self.top_k or 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k < 0 else top_k,
            seed=None if self.seed is None else self.seed + choice_index,
            stop=self.stop_list,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias_pairs,
        )


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions body.

    `max_completion_tokens` is the newer name of `max_tokens`; if both are given they must
    agree. `top_logprobs` (0-20) needs `logprobs: true`. `tool_choice` defaults to "auto"
    with tools and "none" without; "required" or a named function needs tools (and the name
    among them).
    """

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _same_as_max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            raise ValueError(f"conflicts with max_tokens ({other} != {v}); give only one")
        return v

    @field_validator("messages")
    @classmethod
    def _tool_results_answer_calls(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        calls: set[str] = set()
        for i, m in enumerate(v):
            calls.update(c.id for c in m.tool_calls or ())
            if m.role == "tool" and m.tool_call_id not in calls:
                raise ParamError(
                    f"messages[{i}].tool_call_id",
                    f"message {i} (role 'tool') answers tool_call_id {m.tool_call_id!r}, "
                    "which no earlier assistant message's tool_calls has; a 'tool' message "
                    "must answer a preceding tool call")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        check_distinct_tool_names([t.function.name for t in v or ()])
        return v or None

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        names = [t.function.name for t in tools]
        if v == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"tool_choice names function {v.function.name!r}, which is not "
                             f"in tools ({', '.join(names) or 'none given'})")
        return v

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated_functions(cls, v: Any) -> Any:
        if v:
            raise ValueError("the deprecated functions/function_call are not supported; "
                             "use tools and tool_choice")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tools are used: "none" (not rendered, not parsed), "auto" (the model
        chooses), "required" / "named" (a call is forced by a grammar)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    @property
    def forced_tool_name(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice,
                                                            NamedToolChoice) else None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions body.

    `prompt` is a string or a list of token ids; a list holding exactly one of those is
    unwrapped. Several prompts per request (batch), `suffix`, `echo` and `best_of` > n are
    refused. `logprobs` (0-5): each token's logprob and that many alternatives.
    """

    prompt: str | list[int]
    suffix: str | None = None
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and not isinstance(v[0], int):
            if len(v) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(v)}")
            v = v[0]
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix_unsupported(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("echo")
    @classmethod
    def _echo_unsupported(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported yet")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of different from n is not supported")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# --------------------------------------------------------------------------- responses

# "grammar_error": a forced structure (response_format, a forced tool call) could not be
# completed; the output is cut where the grammar failed (docs/operations.md)
ApiFinishReason = Literal["stop", "length", "tool_calls", "grammar_error"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request (all choices).

    `prompt_tokens` counts the prompt once, however many choices; `completion_tokens` sums
    every choice; `cached_tokens` is prompt tokens served from the prefix cache.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class AssistantMessage(BaseModel):
    """The reply; `content` is None when the message is only tool calls. `tool_calls` is
    left out of the JSON when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallMessage] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class TopLogprob(BaseModel):
    """One alternative token: its text, natural-log probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    """A sampled token, with the most likely alternatives at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """`choices[].logprobs` of a chat completion (and of each stream chunk)."""

    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """`choices[].logprobs` of a text completion (legacy OpenAI shape): parallel lists;
    `text_offset[i]` is the character offset of token i in the completion text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: ApiFinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    flare: dict[str, Any] | None = None  # extension, docs/api-extensions.md


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: ApiFinishReason
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage
    flare: dict[str, Any] | None = None  # extension, docs/api-extensions.md


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flare"
    max_model_len: int | None = None  # vLLM's extension: the package's max_seq_len


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
