"""Continuous batching with chunked prefill over a fixed page pool.

Each step: every running sequence that is decoding gets one token; the rest of the step's
token budget goes to prefill chunks (running prefills first, then newly admitted
sequences, in arrival order). Pages are taken as a chunk needs them; when the pool runs
short, unpinned cached pages are evicted first (LRU). When a decode step still finds no
free page, the most recently admitted sequence is preempted (its pages released; it is
recomputed later from its tokens, reusing what the prefix index still holds), so older
requests always make progress.

On admission a sequence adopts the longest cached prefix of its tokens (`DeviceReuse`), so
its prefill starts where the cache ends. A waiting sequence whose prefix another sequence
is prefilling right now waits for those pages instead of computing them too.

Hybrid recipes: a running sequence also holds one state slot (`StateSlotPool`), taken zeroed
at admission (a reused endpoint's checkpoint is copied into it) and given back when it
finishes, is aborted or preempted (a preempted sequence recomputes, or restores, its state
at its next admission). Prefill chunks are cut at multiples of `checkpoint_interval` so the
engine can checkpoint the state on that grid, and (`checkpoint_before_prompt_end`) one
token before the end of the prompt, so the engine can checkpoint the state at len - 1: the
endpoint a request with the very same prompt (a retry, n > 1 choices) adopts, since one
token must be computed to get logits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flare.runtime.sequence import Sequence, SeqStatus
from flare.state.admission import DeviceReuse
from flare.state.pools import PagePool, PoolExhausted
from flare.state.prefix_index import common_prefix
from flare.state.slots import StateSlotPool


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, from position `seq.num_computed`, to compute this step."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens (its logits are used)."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    """Chooses each step's work and keeps every page a sequence holds accounted for.

    Args:
        pool: the KV page pool.
        page_size: tokens per page.
        max_num_seqs: most running sequences.
        max_batch_tokens: most tokens in one step (>= max_num_seqs, so decodes always fit).
        reuse: admission of cached prefixes (None: no reuse).
        states: hybrid recipes: the state-slot pool (one slot per running sequence).
        checkpoint_interval: cut prefill chunks at multiples of this many tokens (0: no
            cut).
        checkpoint_before_prompt_end: also end a prefill chunk at `num_prompt_tokens - 1`
            (hybrid recipes with checkpoints: the engine checkpoints there, so the same
            prompt sent again reuses all but its last token).
    """

    def __init__(self, pool: PagePool, page_size: int, max_num_seqs: int,
                 max_batch_tokens: int, reuse: DeviceReuse | None = None,
                 states: StateSlotPool | None = None, checkpoint_interval: int = 0,
                 checkpoint_before_prompt_end: bool = False) -> None:
        self.pool = pool
        self.reuse = reuse
        self.states = states
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_before_prompt_end = checkpoint_before_prompt_end
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max(max_batch_tokens, max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        end = seq.num_computed + num_tokens
        return max(0, -(-end // self.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self._pages_needed(seq, num_tokens)
        if need > self.pool.num_free and self.reuse is not None:
            self.reuse.index.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return False
        seq.pages.extend(self.pool.allocate(need))
        return True

    def _drop_pages(self, seq: Sequence) -> None:
        """Release every page and the state slot of `seq`; it will be computed again from
        its tokens (or restored from what the caches still hold)."""
        self.pool.release(seq.pages)
        seq.pages = []
        seq.page_keys = []
        seq.num_computed = 0
        seq.needs_lookup = True
        self._release_slot(seq)

    def _take_slot(self, seq: Sequence) -> None:
        """Give `seq` a zeroed state slot (hybrid recipes), retiring a checkpoint if the
        pool is short (it cannot be while checkpoints stay within their budget)."""
        if self.states is None or seq.state_slot >= 0:
            return
        try:
            seq.state_slot = self.states.allocate()
        except PoolExhausted:
            ckpts = self.reuse.checkpoints if self.reuse is not None else None
            if ckpts is None or ckpts.evict(1) == 0:
                raise
            seq.state_slot = self.states.allocate()

    def _release_slot(self, seq: Sequence) -> None:
        if self.states is not None and seq.state_slot >= 0:
            self.states.release(seq.state_slot)
        seq.state_slot = -1

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute now: what is left, within `budget`, and for a prefill
        not past the next multiple of the checkpoint interval (nor, with
        `checkpoint_before_prompt_end`, past the prompt's last token but one)."""
        n = min(seq.num_uncomputed, budget)
        step = self.checkpoint_interval
        if step and n > 1:
            n = min(n, (seq.num_computed // step + 1) * step - seq.num_computed)
        before_end = seq.num_prompt_tokens - 1
        if self.checkpoint_before_prompt_end and seq.num_computed < before_end < (
                seq.num_computed + n):
            n = before_end - seq.num_computed
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_pages(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledChunk]:
        """The step's chunks: decodes first, then prefill chunks within the token budget."""
        budget = self.max_batch_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.is_prefilling:
                continue
            while not self._grow(seq, 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                decodes.append(ScheduledChunk(seq, 1))
                budget -= 1
        decoding = {c.seq for c in decodes}
        for seq in self.running:
            if budget <= 0:
                break
            if seq in decoding or not seq.is_prefilling:
                continue
            n = self._chunk(seq, budget)
            if self._grow(seq, n):
                prefills.append(ScheduledChunk(seq, n))
                budget -= n
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.ticket is not None and not seq.ticket.done.is_set():
                continue  # its state is on its way from disk; the others go on
            if self._follows_a_prefill(seq):
                continue  # a running prefill is computing its prefix: adopt it after
            self._take_slot(seq)
            if seq.needs_lookup and self.reuse is not None:
                if not self._adopt_cached_prefix(seq):
                    self._release_slot(seq)  # waits for a transfer ticket, holding nothing
                    continue
            n = self._chunk(seq, budget)
            if not self._grow(seq, n):
                # admit in arrival order only: the head waits for pages, holding none (a
                # waiting sequence that held pages could starve the running ones)
                self._drop_pages(seq)
                break
            if self.reuse is not None:  # the adopted prefix is now really skipped
                self._count_lookup(seq, seq.num_computed)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, n))
            budget -= n
        return decodes + prefills

    def _follows_a_prefill(self, seq: Sequence) -> bool:
        """Whether a running sequence is prefilling a prefix of `seq`'s tokens that it has
        not computed yet (at least one more page): then `seq` waits and adopts those pages
        once published, instead of computing the same prefix alongside (case
        state-concurrent-same-prefix; `n > 1` choices share their prompt this way)."""
        if self.reuse is None or not seq.needs_lookup or seq.num_prompt_tokens <= self.page_size:
            return False
        ps, tokens = self.page_size, seq.token_ids
        for r in self.running:
            if not r.is_prefilling or r.token_ids[:ps] != tokens[:ps]:
                continue
            shared = common_prefix(tuple(r.token_ids[:r.num_prompt_tokens]), tokens)
            if shared >= r.num_computed + ps:
                return True
        return False

    @property
    def waiting_on_transfers(self) -> bool:
        """True when every waiting sequence waits for a transfer ticket and none runs
        (the engine then sleeps until a ticket completes instead of spinning)."""
        return (not self.running and bool(self.waiting)
                and all(s.ticket is not None and not s.ticket.done.is_set()
                        for s in self.waiting))

    def _drop_ticket(self, seq: Sequence) -> None:
        if seq.ticket is not None:
            if self.reuse is not None and self.reuse.tiers is not None:
                self.reuse.tiers.transfers.drop_waiter(seq.ticket, seq.request_id)
            seq.ticket = None

    def _adopt_cached_prefix(self, seq: Sequence) -> bool:
        """Look the prefix index up for an admission attempt and adopt what it finds (a head
        that must wait for pages drops it again and looks up at its next attempt). Returns
        False when the sequence must first wait for a transfer ticket (`seq.ticket`)."""
        ticket = seq.ticket
        r = self.reuse.acquire(seq.token_ids, seq.state_slot, seq.request_id, ticket)
        if r.wait is not None:
            if ticket is not None:
                self._drop_ticket(seq)
            seq.ticket = r.wait
            return False
        self._drop_ticket(seq)
        seq.pages, seq.page_keys = list(r.pages), list(r.keys)
        seq.num_computed = r.num_tokens
        seq.needs_lookup = False
        if seq.lookup_counted or seq.lookup_counts is not None:
            self.reuse.counters.record_retry()  # counted already, or superseded by this one
        if not seq.lookup_counted:  # the client hears about the deciding lookup
            seq.lookup_counts = r.counts
            seq.reuse = {"outcome": r.outcome.value, "matched_tokens": r.matched_tokens,
                         "reused_tokens": r.num_tokens, "tier": r.tier}
            seq.num_cached_tokens = r.num_tokens
        return True

    def _count_lookup(self, seq: Sequence, reused: int) -> None:
        """Count `seq`'s deciding lookup once per request (`ReuseCounters.record`) and the
        `reused` tokens its admission skips; a preempted sequence's re-admission counts
        them as retry tokens instead."""
        counters = self.reuse.counters
        if seq.lookup_counted:
            counters.retry_reused_tokens += reused
            return
        if seq.lookup_counts is not None:
            counters.record(*seq.lookup_counts)
        seq.lookup_counts, seq.lookup_counted = None, True
        counters.reused_tokens += reused

    def finish(self, seq: Sequence) -> None:
        """Release everything `seq` holds and forget it (idempotent)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.pages:
            self.pool.release(seq.pages)
            seq.pages = []
        self._release_slot(seq)
        self._drop_ticket(seq)  # a cancelled restore: its copy is not ours to stop
        if self.reuse is not None and seq.lookup_counts is not None:
            self._count_lookup(seq, 0)  # looked up, never ran: its last lookup counts
        seq.status = SeqStatus.FINISHED
