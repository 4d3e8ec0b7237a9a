"""OpenAI's response bodies: chat completions and text completions (their choices, usage
and logprobs) and the model list. The `flare` object is Flare's extension
(docs/api-extensions.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from flare.server.openai.messages import ToolCallMessage

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
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
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


class _CompletionBody(BaseModel):
    """The fields chat and text completions share, in OpenAI's order; each subclass names
    its `object` and the type of its choices (pydantic keeps an overridden field's place)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[Any]
    usage: Usage
    flare: dict[str, Any] | None = None  # extension, docs/api-extensions.md


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: ApiFinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_CompletionBody):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: ApiFinishReason
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_CompletionBody):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flare"
    max_model_len: int | None = None  # vLLM's extension: the package's max_seq_len


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
