"""Admission of a reuse: exactly one outcome per lookup, and counters that add up.

A lookup *hit* means a usable cached prefix exists; only an *Admitted* hit reuses anything.
The counters keep lookups, hits, each outcome, admitted tokens and actually reused tokens
apart, so that:

    lookups = NoMatch + hits
    hits    = CostRejected + CapacityRejected + EnqueueRejected + Admitted
    reused tokens <= admitted tokens <= queried tokens

Each request counts once: `DeviceReuse.acquire` decides and adopts but counts nothing; the
scheduler counts a request's deciding lookup (the one after which it starts running, or
its last one when it ends before running) with `ReuseCounters.record`, and every other
lookup of it (a queue head that gave its adoption back to wait for pages, a preempted
sequence looking up again) with `ReuseCounters.record_retry`. So `prefix_cache_queries`
is the prompt tokens of the requests looked up, and `prefix_cache_hits /
prefix_cache_queries` is a hit ratio per prompt token.

The cost policy is an arm: `CostPolicy.admit(match_tokens, tier)` decides whether restoring
is worth it. For pages already in the device pool restoring costs nothing, so the default
arm admits; tiered storage (host, disk) gives it real transfer estimates.

For a hybrid recipe (`DeviceReuse` given a `CheckpointIndex`) the usable match is an
endpoint: the largest checkpoint position P at or below the cached KV prefix (and at most
len - 1). Restoring it is all or nothing: the checkpoint's slot is copied into the
sequence's own slot together with the copy-on-write of the partial page; if any part of
that fails, everything taken is given back, the sequence's slot is zeroed and the request
computes from position 0 (an Admitted lookup that reused nothing, counted in
`restore_failures`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flare.state.checkpoints import Checkpoint, CheckpointIndex
    from flare.state.pools import KVCache
    from flare.state.prefix_index import PrefixIndex
    from flare.state.slots import StateSlotPool
    from flare.state.transfer import Ticket

log = logging.getLogger(__name__)


class TierPromoter(Protocol):
    """What admission asks of the tiers below the device pool; `flare.state.tiers.TierStore`
    is the implementation. Admission and tiers meet here, so neither imports the other
    both ways: tiers import admission's `Outcome` and `CostPolicy`, admission only this."""

    def promote(self, tokens: list[int], limit: int, waiter: str,
                ticket: "Ticket | None" = None) -> Any:
        """Bring the part of `tokens[:limit]`'s state held below the device into the device
        pools when worth its cost; returns a `flare.state.promotion.PromoteResult`."""


class Outcome(str, enum.Enum):
    NO_MATCH = "NoMatch"
    COST_REJECTED = "CostRejected"
    CAPACITY_REJECTED = "CapacityRejected"
    ENQUEUE_REJECTED = "EnqueueRejected"
    ADMITTED = "Admitted"


# Transfer speeds assumed when prepare measured none (bytes/s): a host memcpy and a local
# SSD read; `flare prepare` measures both on the target machine (manifest tuning).
DEFAULT_BYTES_PER_S = {"device": float("inf"), "host": 4e9, "disk": 4e8}


@dataclass(frozen=True)
class CostPolicy:
    """Admit a restore when its estimated transfer time is below `factor` x the estimated
    prefill time of the tokens it replaces (ARCHITECTURE.md, "Admission of a reuse").

    Attributes:
        factor: the ratio threshold (default 0.5).
        prefill_tokens_per_s: estimated prefill speed, tokens/s.
        bytes_per_s: estimated transfer speed into the device per tier, bytes/s
            ("device" is free); a tier not named is never admitted.
    """

    factor: float = 0.5
    prefill_tokens_per_s: float = 400.0
    bytes_per_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BYTES_PER_S))

    def admit(self, num_tokens: int, num_bytes: int, tier: str = "device") -> bool:
        speed = self.bytes_per_s.get(tier)
        if speed is None:
            return False
        transfer_s = 0.0 if speed == float("inf") else num_bytes / speed
        return transfer_s == 0.0 or transfer_s < self.factor * num_tokens / self.prefill_tokens_per_s


@dataclass
class ReuseCounters:
    """Counters of reuse admission (ints). `*_tokens` count prompt tokens."""

    lookups: int = 0
    hits: int = 0
    outcomes: dict[Outcome, int] = field(default_factory=lambda: {o: 0 for o in Outcome})
    queried_tokens: int = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
    hit_tokens: int = 0  # tokens a hit covered (vLLM: prefix_cache_hits)
    admitted_tokens: int = 0
    reused_tokens: int = 0  # tokens whose prefill was actually skipped (once a request)
    restore_failures: int = 0  # admitted restores that failed and were recomputed
    retries: int = 0  # lookups of a request besides its counted one (waits, preemptions)
    retry_reused_tokens: int = 0  # tokens skipped again by preempted sequences' re-admissions

    def record(self, outcome: Outcome, queried: int, matched: int) -> None:
        """Count a request's one lookup (its deciding one) of `queried` tokens (its prompt)
        with a usable match of `matched` tokens."""
        self.lookups += 1
        self.queried_tokens += queried
        if outcome is not Outcome.NO_MATCH:
            self.hits += 1
            self.hit_tokens += matched
        if outcome is Outcome.ADMITTED:
            self.admitted_tokens += matched
        self.outcomes[outcome] += 1

    def record_retry(self) -> None:
        """Count a lookup of a request that is (or will be) counted by another lookup."""
        self.retries += 1

    def check_conservation(self) -> None:
        """Raises AssertionError when the counters do not add up."""
        o = self.outcomes
        assert self.lookups == o[Outcome.NO_MATCH] + self.hits, "lookups != NoMatch + hits"
        assert self.hits == (o[Outcome.COST_REJECTED] + o[Outcome.CAPACITY_REJECTED]
                             + o[Outcome.ENQUEUE_REJECTED] + o[Outcome.ADMITTED]), \
            "hits != sum of hit outcomes"
        assert self.reused_tokens <= self.admitted_tokens <= self.queried_tokens

    def as_stats(self) -> dict[str, int]:
        """Flat `*_total` counters for /metrics (vLLM names where the meaning is the same)."""
        out = {
            "prefix_cache_queries_total": self.queried_tokens,
            "prefix_cache_hits_total": self.hit_tokens,
            "reuse_lookups_total": self.lookups,
            "reuse_hits_total": self.hits,
            "reuse_admitted_tokens_total": self.admitted_tokens,
            "reuse_reused_tokens_total": self.reused_tokens,
            "reuse_restore_failures_total": self.restore_failures,
            "prefix_cache_retries_total": self.retries,
            "reuse_retry_reused_tokens_total": self.retry_reused_tokens,
        }
        for outcome, n in self.outcomes.items():
            out[f"reuse_outcome_{_snake(outcome.value)}_total"] = n
        return out


@dataclass(frozen=True)
class Reuse:
    """What `DeviceReuse.acquire` gave a sequence.

    Attributes:
        outcome: the admission outcome of the lookup.
        pages: the sequence's page table for positions [0, num_tokens): adopted full pages
            (one new reference each) and, when the match ended inside a page, a private
            copy of that page's first positions. The caller owns these references.
        keys: chained keys of the adopted full pages.
        num_tokens: positions whose K/V is already in `pages` (0 unless Admitted).
        matched_tokens: positions the lookup matched (even when not admitted).
        wait: a transfer ticket (`flare.state.transfer.Ticket`) bringing records from
            disk: the lookup is not decided yet (nothing is counted or adopted); the
            request waits for the ticket and looks up again with it.
        counts: what `ReuseCounters.record` takes for this lookup (outcome, queried
            tokens, matched tokens), for the caller to count once per request; None with
            `wait`.
        tier: where the reused state came from when `num_tokens` > 0: "device" (the
            device pool held it), "host" or "disk" (the slowest tier a part of it was
            promoted from for this lookup); None when nothing is reused.
    """

    outcome: Outcome
    pages: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()
    num_tokens: int = 0
    matched_tokens: int = 0
    wait: Any = None
    counts: tuple[Outcome, int, int] | None = None
    tier: str | None = None


class DeviceReuse:
    """Looks up, admits and adopts cached prefixes held in the device page pool.

    Args:
        index: the prefix index.
        kv: the KV cache (for the copy-on-write of a partly matched page).
        policy: the cost arm.
        counters: where outcomes are counted.
        checkpoints: for hybrid recipes, the checkpoint index: a prefix is then usable
            only up to a checkpoint (KV pages alone are not a state); None for KV-only.
        tiers: the host/disk tiers (`flare.state.tiers.TierStore`): before each device
            lookup, what they hold past the device prefix is promoted when worth it.
    """

    def __init__(self, index: "PrefixIndex", kv: "KVCache", policy: CostPolicy,
                 counters: ReuseCounters, checkpoints: "CheckpointIndex | None" = None,
                 tiers: "TierPromoter | None" = None) -> None:
        self.index, self.kv, self.policy, self.counters = index, kv, policy, counters
        self.checkpoints = checkpoints
        self.tiers = tiers
        self._fallback: tuple[Outcome, int] | None = None
        self._counts: tuple[Outcome, int, int] | None = None

    def checkpoint_usable(self, ckpt: "Checkpoint") -> bool:
        """Whether every KV page of a checkpoint's prefix is still listed."""
        return self.index.covers(ckpt.parent, ckpt.tail)

    def acquire(self, tokens: list[int], state_slot: int = -1, waiter: str = "",
                ticket: "Ticket | None" = None) -> Reuse:
        """Find the longest cached prefix of `tokens` (at most len - 1 positions, so one
        token is computed for logits), decide its outcome, and adopt it when admitted.
        With tiers, what the host and disk tiers hold past the device prefix is promoted
        first; a tier restore that is rejected (cost, capacity, queue) while the device
        holds nothing is the lookup's outcome.

        Args:
            tokens: the request's token ids.
            state_slot: hybrid recipes: the sequence's own, freshly zeroed state slot, into
                which an admitted checkpoint is copied.
            waiter: the request id (held on a disk read ticket).
            ticket: the completed read ticket this request waited for.

        Returns:
            Reuse; with `wait` set, nothing was decided: wait for that ticket, then call
            again passing it. Nothing is counted: the caller counts `counts` once per
            request (`ReuseCounters.record`, other lookups `record_retry`).
        """
        if self.tiers is None:
            return self._counted(self._acquire_device(tokens, state_slot))
        promo = self.tiers.promote(tokens, len(tokens) - 1, waiter, ticket)
        if promo.wait is not None:
            return Reuse(Outcome.NO_MATCH, wait=promo.wait)
        if promo.outcome is not None:
            self._fallback = (promo.outcome, promo.matched_tokens)
        try:
            return self._counted(self._acquire_device(tokens, state_slot),
                                 promo.tier if promo.promoted_tokens else None)
        finally:
            self._fallback = None
            self.index.pool.release(list(promo.held))

    def _counted(self, reuse: Reuse, promoted_from: str | None = None) -> Reuse:
        counts, self._counts = self._counts, None
        tier = (promoted_from or "device") if reuse.num_tokens > 0 else None
        return dataclasses.replace(reuse, counts=counts, tier=tier)

    def _record(self, outcome: Outcome, queried: int, matched: int) -> Outcome:
        """Decide the lookup's one outcome (a rejected tier restore replaces NoMatch) and
        keep its counts for the Reuse returned."""
        if outcome is Outcome.NO_MATCH and self._fallback is not None:
            outcome, matched = self._fallback
        self._counts = (outcome, queried, matched)
        return outcome

    def _acquire_device(self, tokens: list[int], state_slot: int) -> Reuse:
        if self.checkpoints is not None:
            return self._acquire_endpoint(tokens, state_slot)
        match = self.index.match(tokens, limit=len(tokens) - 1)
        n = match.num_tokens
        pool = self.index.pool
        # hold every matched page while deciding, so an eviction for the copy page cannot
        # free one of them
        held = list(match.pages) + ([match.partial] if match.partial is not None else [])
        pool.incref(held)
        copy = None
        if n == 0:
            outcome = Outcome.NO_MATCH
        elif not self.policy.admit(n, n * self.kv.layout.kv_bytes_per_token, "device"):
            outcome = Outcome.COST_REJECTED
        else:
            if match.partial is not None and (pool.num_free > 0 or self.index.evict(1) == 1):
                (copy,) = pool.allocate(1)
            no_room = match.partial is not None and copy is None
            outcome = (Outcome.CAPACITY_REJECTED if no_room and not match.pages
                       else Outcome.ADMITTED)
        if match.partial is not None:
            if copy is not None:
                self.kv.copy_page_prefix(match.partial, copy, match.partial_tokens)
            pool.release([match.partial])
        if outcome is not Outcome.ADMITTED:
            pool.release(list(match.pages))
            outcome = self._record(outcome, len(tokens), n)
            return Reuse(outcome, matched_tokens=n)
        pages = list(match.pages) + ([copy] if copy is not None else [])
        # without a page for the copy, only the whole pages are reused
        used = n if copy is not None or match.partial is None else len(match.pages) * self.index.page_size
        self._record(outcome, len(tokens), used)
        return Reuse(outcome, tuple(pages), match.keys, used, n)

    def _acquire_endpoint(self, tokens: list[int], dst: int) -> Reuse:
        """Hybrid recipes: adopt the endpoint (KV pages of [0, P) + checkpoint at P) with
        the largest P within the cached prefix, all or nothing."""
        ckpts, index, pool = self.checkpoints, self.index, self.index.pool
        states: "StateSlotPool" = ckpts.states
        assert states.is_allocated(dst), "a hybrid sequence looks up without its state slot"
        ps = index.page_size
        match = index.match(tokens, limit=len(tokens) - 1)
        held = list(match.pages) + ([match.partial] if match.partial is not None else [])
        pool.incref(held)  # hold what matched while deciding (an eviction cannot free it)
        ckpt = ckpts.find(tokens, [index.root, *match.keys], match.num_tokens)
        p = ckpt.position if ckpt is not None else 0
        full, rest = divmod(p, ps)
        adopted: list[int] = []
        copy = None
        restored = False
        if ckpt is None:
            outcome = Outcome.NO_MATCH
        elif not self.policy.admit(p, p * self.kv.layout.kv_bytes_per_token
                                   + states.bytes_per_slot, "device"):
            outcome = Outcome.COST_REJECTED
        elif rest and not (pool.num_free > 0 or index.evict(1) == 1):
            outcome = Outcome.CAPACITY_REJECTED  # no page for the copy of the partial page
        else:
            outcome = Outcome.ADMITTED
            if rest:
                (copy,) = pool.allocate(1)
            src = None
            if rest:
                src = match.pages[full] if full < len(match.pages) else match.partial
            ckpts.pin(ckpt)
            try:
                states.copy(ckpt.slot, dst)
                if copy is not None:
                    self.kv.copy_page_prefix(src, copy, rest)
                restored = True
            except Exception:  # all or nothing: recompute from scratch
                log.exception("restore of a checkpoint at position %d failed; recomputing", p)
                self.counters.restore_failures += 1
                states.zero(dst)
            finally:
                ckpts.unpin(ckpt)
            if restored:
                adopted = list(match.pages[:full])
        keep = set(adopted)
        pool.release([page for page in held if page not in keep])
        if not restored and copy is not None:
            pool.release([copy])
            copy = None
        outcome = self._record(outcome, len(tokens), p)
        if not restored:
            return Reuse(outcome, matched_tokens=p)
        pages = adopted + ([copy] if copy is not None else [])
        return Reuse(outcome, tuple(pages), tuple(match.keys[:full]), p, p)


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
