"""Token sampling: log-probabilities, penalties, greedy, temperature, top-k, top-p.

For each row of a step's logits, in this order (each only for the rows whose request asked):
1. (the engine, before `sample`) a token constraint's mask: forbidden tokens get -inf.
2. log-probabilities: log-softmax of those logits, so they describe the model's own
   distribution over the tokens the constraint allows, not the sampler's.
3. logit bias: the request's additive per-token biases (OpenAI's `logit_bias`).
4. penalties: repetition (prompt and completion), then frequency and presence (completion).
5. greedy argmax, or temperature, top-k, top-p and a draw with the request's generator.

Every step reads and writes only its own row, and each request owns a `torch.Generator`, so
a request draws the same tokens (and reports the same logprobs) whether it runs alone or in
a batch, whatever the other rows asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flare.kernels import fused_ops
from flare.runtime.request import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


class TokenHistory(NamedTuple):
    """The tokens a row's penalties look at.

    Attributes:
        token_ids: the prompt followed by the completion tokens generated so far.
        num_prompt_tokens: how many of `token_ids` are the prompt.
        counts: the sequence's running `PenaltyCounts` (the engine keeps one per penalized
            sequence), or None to count `token_ids` afresh.
    """

    token_ids: Sequence[int]
    num_prompt_tokens: int
    counts: PenaltyCounts | None = None


class PenaltyCounts:
    """Token counts one sequence's penalties read, brought up to date by new tokens only.

    Counting the whole history at every step would cost O(prompt + completion) per decoded
    token (a long agent prompt with `repetition_penalty` rebuilt a set of thousands of ids
    per token); `update` counts only the tokens appended since its last call, and applying
    the penalties is O(vocab) whatever the history's length.

    Args:
        vocab: width of the logits rows, V. Token ids outside [0, V) are not counted.

    Attributes:
        seen: bool [V], tokens of the prompt or the completion (repetition penalty).
        completion: float32 [V], times each token occurs in the completion (frequency and
            presence penalties).
        num_counted: how many tokens of the history are counted.
    """

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        self.completion = torch.zeros(vocab, dtype=torch.float32)
        self.num_counted = 0

    def update(self, history: TokenHistory) -> PenaltyCounts:
        """Count the tokens of `history` past `num_counted`; returns self. A history shorter
        than what was counted (it is never cut in the engine) is counted afresh."""
        ids = history.token_ids
        if len(ids) < self.num_counted:
            self.seen.zero_()
            self.completion.zero_()
            self.num_counted = 0
        start = self.num_counted
        if start == len(ids):
            return self
        new = torch.tensor(list(ids[start:]), dtype=torch.int64)
        keep = (new >= 0) & (new < self.vocab)
        self.seen[new[keep]] = True
        first_completion = max(history.num_prompt_tokens - start, 0)  # index into `new`
        done = new[first_completion:]
        done = done[(done >= 0) & (done < self.vocab)]
        self.completion.index_add_(0, done, torch.ones(len(done), dtype=torch.float32))
        self.num_counted = len(ids)
        return self


@dataclass(frozen=True)
class SampleResult:
    """What `sample` picked for N rows.

    Attributes:
        tokens: one token id per row.
        logprobs: per row, the sampled token's `TokenLogprob`, or None where the request
            did not ask for logprobs.
    """

    tokens: list[int]
    logprobs: list[TokenLogprob | None]


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Add the request's `logit_bias` to fp32 logits [vocab] in place; returns `logits`.

    OpenAI's semantics: each bias (in [-100, 100]) is added to its token's logit before
    sampling; -100 all but bans a token, 100 all but forces it. Ids outside [0, vocab) are
    ignored (the server refuses them with a 400 first). A -inf logit stays -inf.
    """
    vocab = logits.shape[-1]
    pairs = [(t, b) for t, b in params.logit_bias if 0 <= t < vocab]
    if pairs:
        ids, biases = zip(*pairs)
        logits[list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    return logits


def apply_penalties(logits: torch.Tensor, params: SamplingParams,
                    history: TokenHistory) -> torch.Tensor:
    """Penalize fp32 logits [vocab] in place for the tokens of `history`; returns `logits`.

    Repetition penalty r (over prompt and completion, each distinct token once): a positive
    logit becomes logit / r, a negative one logit * r. Then, with c the number of times a
    token occurs in the completion so far, logit -= frequency_penalty * c +
    presence_penalty * (c > 0) (OpenAI's formula). Token ids outside [0, vocab) are
    ignored. A -inf logit (masked by a constraint) stays -inf. The counts come from
    `history.counts` (updated here by the tokens it has not seen), or from a fresh count.
    """
    vocab = logits.shape[-1]
    counts = history.counts if history.counts is not None else PenaltyCounts(vocab)
    counts.update(history)
    seen, done = counts.seen.to(logits.device), counts.completion.to(logits.device)
    r = params.repetition_penalty
    if r != 1.0:
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalized, logits))
    if params.frequency_penalty or params.presence_penalty:
        logits -= params.frequency_penalty * done + params.presence_penalty * (done > 0)
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator) -> int:
    """Pick one token id from fp32 logits [vocab] (penalties already applied).

    Order as in transformers' logits processors: temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose mass reaches `top_p`), then a draw.

    Raises:
        RuntimeError: the distribution is degenerate (all -inf, NaN): torch's multinomial.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop_sorted[0] = False  # the most likely token always stays (top_p may round to 0)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of `logits` [N, vocab], as torch.argmax(logits, dim=-1) picks it
    (the first index on ties, the first NaN's where a row has one).

    float32 CPU rows go to the kernels' `argmax_rows` (kernels/sample.cpp: vectorized,
    ~10x torch's CPU argmax on a 49,152-token vocabulary) where they are built; any
    other tensor, or $FLARE_FUSED_OPS=0, takes torch.argmax.
    """
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[-1] > 0):
        argmax_rows = getattr(fused_ops(), "argmax_rows", None)
        if argmax_rows is not None:
            return argmax_rows(logits.contiguous()).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator],
           histories: Sequence[TokenHistory] | None = None) -> SampleResult:
    """Pick a token for each row of fp32 logits [N, vocab] (module docstring for the order).

    Args:
        logits: [N, vocab] fp32, after any constraint mask; biased and penalized rows are
            modified in place.
        params: N requests' sampling parameters.
        generators: N per-request generators (used by sampled rows only).
        histories: N token histories, needed when any row has a penalty (None: no row is
            penalized); a history's `counts` is brought up to date in place.

    Log-probabilities (log-softmax over the vocabulary, natural log) and the top-k
    alternatives are computed only for rows whose `params.logprobs` is not None; rows
    without penalties are not touched. Greedy rows are taken in one argmax; sampled rows
    each draw from their own generator. A sampled row whose distribution is degenerate
    falls back to the argmax rather than fail the batch.

    Raises:
        ValueError: a penalized row without a history.
    """
    want = [row for row, p in enumerate(params) if p.logprobs is not None]
    logprobs = torch.log_softmax(logits[want], dim=-1) if want else None  # [R, vocab]
    for row, p in enumerate(params):
        if p.logit_bias:
            apply_logit_bias(logits[row], p)
        if p.penalized:
            if histories is None:
                raise ValueError(f"row {row} has penalties but no token history was given")
            apply_penalties(logits[row], p, histories[row])
    out = greedy_tokens(logits)
    for row, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            try:
                out[row] = sample_one(logits[row], p, g)
            except RuntimeError:  # degenerate distribution: one row must not fail the batch
                log.warning("sampling row %d failed (%s); taking the argmax", row, p)
    result: list[TokenLogprob | None] = [None] * len(out)
    if logprobs is not None:
        chosen = torch.tensor([out[row] for row in want], device=logprobs.device)
        picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()  # [R]
        k = min(max(params[row].logprobs or 0 for row in want), logprobs.shape[-1])
        top_vals: list[list[float]] = [[] for _ in want]
        top_ids: list[list[int]] = [[] for _ in want]
        if k > 0:
            vals, idx = torch.topk(logprobs, k, dim=-1)  # [R, k], most likely first
            top_vals, top_ids = vals.tolist(), idx.tolist()
        for i, row in enumerate(want):
            n = params[row].logprobs or 0
            result[row] = TokenLogprob(out[row], picked[i],
                                       tuple(zip(top_ids[i][:n], top_vals[i][:n])))
    return SampleResult(out, result)
