"""Token sampling: greedy, temperature, top-k, top-p, with a generator per request.

Each request owns a `torch.Generator`, so a seeded request draws the same tokens whether
it runs alone or in a batch: no row's draw depends on another row.
"""

from __future__ import annotations

import logging

import torch

from flare.runtime.request import SamplingParams

log = logging.getLogger(__name__)


def sample_one(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator) -> int:
    """Pick one token id from fp32 logits [vocab].

    Order as in transformers' logits processors: temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose mass reaches `top_p`), then a draw.
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


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """Pick a token for each row of fp32 logits [N, vocab]; returns N token ids.

    Greedy rows are taken in one argmax; sampled rows each use their own generator.
    """
    out = torch.argmax(logits, dim=-1).tolist()
    for row, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            try:
                out[row] = sample_one(logits[row], p, g)
            except RuntimeError:  # degenerate distribution: one row must not fail the batch
                log.warning("sampling row %d failed (%s); taking the argmax", row, p)
    return out
