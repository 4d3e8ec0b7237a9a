"""What crosses the boundary between the HTTP layer and the engine.

The server turns an OpenAI request into one `GenerationRequest` per choice; the engine
answers with a stream of `RequestOutput` items, one per engine step that produced something
for that request. Nothing here knows about HTTP or about tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

# "grammar_error": the request's grammar constraint failed mid-generation (its output is
# not what the grammar promised); docs/operations.md
FinishReason = Literal["stop", "length", "abort", "grammar_error"]


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one sequence.

    Attributes:
        max_tokens: most completion tokens to generate (>= 1).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: seeds a per-request `torch.Generator`, so the same seed gives the same
            tokens whether the request runs alone or batched. None draws from the
            engine's generator.
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: token ids that end generation (EOS ids are added by the engine
            unless `ignore_eos`); the stop token is not part of the returned text.
        ignore_eos: keep going past end-of-sequence tokens (benchmarks).
        logprobs: None: no log-probabilities (nothing is computed). k >= 0: every sampled
            token's log-probability plus the k most likely alternatives
            (`RequestOutput.logprobs`), from the model's log-softmax after any token
            constraint's mask, before penalties, temperature, top-k and top-p.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token that
            appears in the completion so far (OpenAI's).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it
            appears in the completion so far (OpenAI's).
        repetition_penalty: > 0; for every token of the prompt or the completion so far, a
            positive logit is divided by it and a negative one multiplied (transformers' and
            vLLM's). 1 disables it.
        logit_bias: (token id, bias) pairs, each bias in [-100, 100], added to the token's
            logit after logprobs are taken and before penalties (OpenAI's `logit_bias`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 and finite, "
                             f"got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:  # also refuses NaN
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in "
                                 f"[-100, 100], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        # a temperature this small is argmax in fp32 anyway, and dividing by it overflows
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one sampled token, and of the most likely alternatives.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability (<= 0; -inf where a constraint forbade it).
        top: up to k `(token_id, logprob)` pairs, most likely first (k is
            `SamplingParams.logprobs`); may or may not contain the sampled token.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@runtime_checkable
class TokenConstraint(Protocol):
    """A per-request constraint on which token may come next (e.g. a JSON grammar).

    The engine calls `allowed()` before each sampling of the request, masks every other
    token out of the logits, samples, then calls `advance(token)`. When `is_done()` is
    True after an advance, the sequence finishes with "stop". One object per request: it
    is stateful and is only called from the engine thread.
    """

    def allowed(self, vocab_size: int) -> "torch.Tensor | None":
        """Bool mask [vocab_size] of tokens allowed next, or None when any is."""

    def advance(self, token_id: int) -> None:
        """Record that `token_id` was sampled."""

    def is_done(self) -> bool:
        """Whether the constrained output is complete (nothing more may follow)."""


@dataclass
class GenerationRequest:
    """One sequence to generate.

    Attributes:
        request_id: unique among live requests (the server appends the choice index).
        prompt_token_ids: the full prompt, already templated and tokenized.
        params: sampling and stopping.
        arrival_ns: `time.monotonic_ns()` when the server received it (server clock).
        constraint: optional token constraint (structured output, forced tool calls).
        session: a session name (`flare.state.sessions`): when the request finishes, the
            session's latest state becomes the tokens it computed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_ns: int = 0
    constraint: TokenConstraint | None = None
    session: str | None = None


@dataclass(frozen=True)
class RequestTimings:
    """Server-clock timestamps of one request, `time.monotonic_ns()` (ns)."""

    arrival_ns: int
    scheduled_ns: int | None = None  # first step that worked on it (queue end)
    first_token_ns: int | None = None
    finished_ns: int | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request.

    Attributes:
        request_id: the request this belongs to.
        token_ids: completion tokens produced in this step (may be empty when the step only
            prefilled, or when text is held back).
        text: new completion text, safe to send: never a partial UTF-8 character, never a
            prefix of a stop string that may still complete.
        finished: True on the last output of the request.
        finish_reason: "stop", "length", "abort" or "grammar_error" when finished,
            else None.
        num_prompt_tokens: tokens in the prompt.
        num_completion_tokens: completion tokens so far (all steps).
        num_cached_tokens: prompt tokens served from the prefix cache, not computed.
        timings: server clock, filled on the final output.
        error: set when the engine failed this request (finish_reason is "abort").
        logprobs: None unless the request asked (`SamplingParams.logprobs`); then one entry
            per token of `token_ids` that is part of the text, in order: a final stop token
            (end-of-sequence or a `stop_token_ids` id) has none.
        reuse: on the final output, how the prompt's cached state was looked up and used:
            {"outcome": "NoMatch" | "CostRejected" | "CapacityRejected" |
            "EnqueueRejected" | "Admitted", "matched_tokens": int, "reused_tokens": int,
            "tier": "device" | "host" | "disk" | None (where the reused state came from;
            None when nothing was reused)}; None when the engine has no prefix cache.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    error: str | None = None
    reuse: dict[str, object] | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


class RequestRejected(ValueError):
    """A request the engine cannot serve (empty prompt, prompt beyond the plan, a session
    over its pinning budget); `param` and `code` name the field and the reason for an
    API error when known."""

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code
