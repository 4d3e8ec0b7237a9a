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

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from flare.runtime.request import SamplingParams
from flare.server.api_error import ParamError
from flare.server.openai.messages import ChatMessage, NamedToolChoice, Tool
from flare.server.request_rules import StrictRequest, ToolRequest, check_schema, refused
from flare.state.sessions import SessionError, check_name

MAX_STOP_SEQUENCES = 4


class JsonSchemaFormat(StrictRequest):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_schema(v)
        return v


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _only_for_json_schema(cls, v: JsonSchemaFormat | None, info: ValidationInfo):
        if v is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema is only allowed with type 'json_schema'")
        return v

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


class StreamOptions(StrictRequest):
    include_usage: bool = False


class _SamplingRequest(StrictRequest):
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
            top_k=max(top_k, 0),
            seed=None if self.seed is None else self.seed + choice_index,
            stop=self.stop_list,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias_pairs,
        )


class ChatCompletionRequest(_SamplingRequest, ToolRequest):
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

    _deprecated_functions = refused("functions", "function_call", message=(
        "the deprecated functions/function_call are not supported; use tools and "
        "tool_choice"))

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    # tool checks, `tool_mode` and `forced_tool_name`: `ToolRequest`'s
    named_choice = NamedToolChoice

    @staticmethod
    def tool_name(tool: Tool) -> str:
        return tool.function.name

    @staticmethod
    def choice_name(choice: NamedToolChoice) -> str:
        return choice.function.name


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

    _suffix_unsupported = refused("suffix", message="suffix is not supported")
    _echo_unsupported = refused("echo", message="echo is not supported yet")

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of different from n is not supported")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
