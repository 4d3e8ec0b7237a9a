"""A sequence being served: its tokens, its pages (and for hybrid recipes its state slot),
how far its state is computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from flare.runtime.request import FinishReason, GenerationRequest
from flare.runtime.sampling import PenaltyCounts


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages and no state slot
    RUNNING = "running"  # holds pages (and a state slot); prefilling or decoding
    FINISHED = "finished"  # pages and slot released


@dataclass(eq=False)
class Sequence:
    """Per-sequence engine state.

    Attributes:
        request: what the client asked for.
        token_ids: prompt followed by the completion tokens generated so far.
        num_prompt_tokens: length of the prompt.
        num_computed: tokens whose K/V is in the cache; `token_ids[num_computed:]` is what
            the next steps must still compute (more than one while prefilling, exactly one
            while decoding: the last sampled token).
        pages: page table; position p lives in page `pages[p // page_size]`.
        max_len: the sequence ends with "length" once it has this many tokens.
        generator: per-request RNG for sampling.
        page_keys: prefix-index keys of the first len(page_keys) pages (full, published or
            adopted); the next full page is published under `page_keys[-1]`.
        reuse: the deciding admission's outcome (the lookup after which it first ran),
            as reported to the client.
        needs_lookup: look the prefix index up at the next admission (again after a
            preemption, which drops the pages).
        state_slot: hybrid recipes: the `StateSlotPool` slot holding every conv/recurrent
            layer state at position `num_computed` (-1 while it holds none: waiting,
            finished, or a KV-only recipe).
        ticket: a transfer ticket bringing this sequence's state from disk; while it is
            not done the sequence waits (holding no pages and no slot).
        penalty_counts: running token counts for a penalized request's sampling
            (`flare.runtime.sampling.PenaltyCounts`), made at its first sampled token.
        lookup_counts: the counts of its latest prefix-cache lookup not counted yet
            (`Reuse.counts`); the scheduler counts a request's deciding lookup once.
        lookup_counted: its one lookup is counted; later lookups are retries.
    """

    request: GenerationRequest
    token_ids: list[int]
    num_prompt_tokens: int
    max_len: int
    generator: torch.Generator
    num_computed: int = 0
    num_cached_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)
    reuse: dict[str, object] | None = None
    needs_lookup: bool = True
    state_slot: int = -1
    ticket: Any = None
    penalty_counts: PenaltyCounts | None = None
    lookup_counts: tuple | None = None
    lookup_counted: bool = False
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    scheduled_ns: int | None = None
    first_token_ns: int | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1
