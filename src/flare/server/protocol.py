"""OpenAI-compatible request and response schemas for /v1/chat/completions and /v1/completions.

Requests are validated here (types, ranges, parameters Flare does not support); anything that
fails becomes an HTTP 400 with OpenAI's error body `{"error": {message, type, param, code}}`
naming the parameter. Unknown extra fields are ignored, as agent clients send many.

Extensions over OpenAI: `top_k` (0 or -1 disables) and `ignore_eos`. Limits that depend on
the served package or settings (n, context length, model name) are checked by the app.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from flare.runtime.request import SamplingParams

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
    branches' messages are joined with " or ".
    """
    if not errors:
        return ApiError(400, "Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return ApiError(400, f"Invalid JSON body: {detail}", code="invalid_json")
    param = _format_loc(first.get("loc", ()))
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
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param)


# --------------------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


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


class ChatMessage(_Request):
    """One message of a conversation. `content` is normalized to a string (or None)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # validate_default: a missing content must reach the required-for-role check.
    content: str | None = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None

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
    def _no_tool_calls(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tool calls in messages are not supported yet")
        return v


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions, in validation order."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False

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

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty_unsupported(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v:
            raise ValueError(f"{info.field_name} is not supported; only 0 is accepted")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_unsupported(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

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
        )


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions body.

    `max_completion_tokens` is the newer name of `max_tokens`; if both are given they must
    agree. `tools` is refused for now (tool calling is not implemented yet); `tool_choice`
    is accepted only as "none" or "auto" without tools.
    """

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _same_as_max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            raise ValueError(f"conflicts with max_tokens ({other} != {v}); give only one")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_unsupported(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported yet")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_unsupported(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported yet")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "text") != "text":
            raise ValueError(f"response_format type {v.get('type')!r} is not supported yet")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _tools_unsupported(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tool calling is not supported yet")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_without_tools(cls, v: str | dict[str, Any] | None):
        if v not in (None, "none", "auto"):
            raise ValueError("tool_choice other than 'none' needs tools, not supported yet")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions body.

    `prompt` is a string or a list of token ids; a list holding exactly one of those is
    unwrapped. Several prompts per request (batch), `suffix`, `echo`, `best_of` > n and
    `logprobs` are refused.
    """

    prompt: str | list[int]
    suffix: str | None = None
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None

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

    @field_validator("logprobs")
    @classmethod
    def _logprobs_unsupported(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported yet")
        return v


# --------------------------------------------------------------------------- responses

ApiFinishReason = Literal["stop", "length"]


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
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: ApiFinishReason
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: ApiFinishReason
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flare"
    max_model_len: int | None = None  # vLLM's extension: the package's max_seq_len


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
