"""Checkpoint index: copies of a hybrid sequence's layer states at chosen token positions.

A recurrent or convolution state exists only at the position where it was taken, so a
hybrid model can reuse a prefix only up to a *checkpoint*: a state slot holding a copy of
every hybrid layer's conv/recurrent state at position P. Together with the KV pages of
[0, P) (held by the prefix index, not here) it forms an *endpoint state*; the pages alone
are not a usable state (ARCHITECTURE.md, "Full conversation state").

Keys are those of the prefix index: a checkpoint at P is filed under the chained key of
its full pages [0, P // page_size) (`page_key`, rooted in the namespace) plus the tokens
of its partial page, `tokens[P // page_size * page_size : P]`. A lookup walks the request's
cached pages and asks, at each page depth, for the checkpoints whose partial tokens match;
so finding one costs a dictionary look-up per page depth.

Lifecycle (see docs/session-state.md):
- publish: the engine copies a live slot into a checkpoint slot between two steps, after
  the step that brought the state to P completed (publish after compute);
- use: an admission pins the checkpoint while it copies it into the sequence's own slot;
- retire: when checkpoint slots run short, the least recently used unpinned checkpoint
  (one whose KV pages are gone first) gives its slot back to the pool.
At most `capacity` checkpoints exist at once, so live sequences always find a slot.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flare.state.pools import PoolExhausted
from flare.state.slots import StateSlotPool

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Checkpoint:
    """A published checkpoint: state slot `slot` holds every layer state at `position`.

    Attributes:
        slot: the state slot it owns (allocated from the pool, one owner).
        parent: chained key of its full pages [0, position // page_size) (the root key
            when there are none).
        tail: token ids of [position // page_size * page_size, position) (may be empty).
        position: P, the number of tokens the state has seen.
        last_used: LRU clock.
        pins: admissions copying from it right now (never evicted while > 0).
    """

    slot: int
    parent: bytes
    tail: tuple[int, ...]
    position: int
    last_used: int = 0
    pins: int = 0


@dataclass
class CheckpointStats:
    """Counters of the checkpoint index (engine stats name them)."""

    published: int = 0
    evicted: int = 0
    failed: int = 0  # a copy into a checkpoint slot raised: nothing was published


class CheckpointIndex:
    """Published checkpoints of one namespace, each owning one slot of a `StateSlotPool`.

    Args:
        states: the state-slot pool (live slots and checkpoint slots come from it).
        capacity: most checkpoints held at once (the plan's `checkpoint_slots`).
        page_size: tokens per KV page (to split a position into pages and tail).
    """

    def __init__(self, states: StateSlotPool, capacity: int, page_size: int) -> None:
        self.states = states
        self.capacity = capacity
        self.page_size = page_size
        self._by_parent: dict[bytes, dict[tuple[int, ...], Checkpoint]] = {}
        self._clock = itertools.count(1)
        self._count = 0  # kept apart so stats() from another thread never iterates the map
        self.stats = CheckpointStats()
        # called with each checkpoint `evict` retires, while its slot is still intact (the
        # host tier keeps a copy: flare.state.tiers)
        self.on_evict: Callable[[Checkpoint], None] | None = None

    def __len__(self) -> int:
        return self._count

    def entries(self) -> list[Checkpoint]:
        return [c for d in self._by_parent.values() for c in d.values()]

    def held_slots(self) -> list[int]:
        return [c.slot for c in self.entries()]

    # ---- publish ------------------------------------------------------------------------

    def publish(self, parent: bytes, tail: tuple[int, ...], position: int, src_slot: int,
                usable: Callable[[Checkpoint], bool] | None = None) -> Checkpoint | None:
        """Copy live slot `src_slot` (the state at `position`) into a checkpoint slot and
        list it. Call between steps, after the step that produced the state completed.

        An equal checkpoint (same key) is only touched. When all `capacity` checkpoints
        exist, one unpinned checkpoint is evicted first (see `evict`). Returns the listed
        checkpoint, or None when nothing was listed (no capacity, all pinned, or the copy
        failed: then its slot is back in the pool and nothing half-written is visible).
        """
        assert position == (position // self.page_size) * self.page_size + len(tail)
        if self._existing(parent, tail) is not None:
            return None
        return self._fill(parent, tail, position, lambda slot: self.states.copy(src_slot, slot),
                          usable)

    def publish_state(self, parent: bytes, tail: tuple[int, ...], position: int,
                      tensors: dict[str, "torch.Tensor"]) -> Checkpoint | None:
        """List a checkpoint restored from a lower tier: `tensors` (as `StateSlotPool.read`
        gives them) are written into a fresh checkpoint slot. Returns the listed checkpoint
        (an equal one that exists is touched and returned instead), or None when there is
        no capacity. Raises ValueError (from `StateSlotPool.write`) when `tensors` do not
        match the layout; the slot is then back in the pool and nothing is listed."""
        existing = self._existing(parent, tail)
        if existing is not None:
            return existing
        return self._fill(parent, tail, position,
                          lambda slot: self.states.write(slot, tensors))

    def get(self, parent: bytes, tail: tuple[int, ...]) -> Checkpoint | None:
        """The listed checkpoint at `parent`'s pages plus `tail`, or None (not touched)."""
        return self._by_parent.get(parent, {}).get(tail)

    def _existing(self, parent: bytes, tail: tuple[int, ...]) -> Checkpoint | None:
        """The listed checkpoint under this key, touched (LRU), or None."""
        ckpt = self._by_parent.get(parent, {}).get(tail)
        if ckpt is not None:
            ckpt.last_used = next(self._clock)
        return ckpt

    def _fill(self, parent: bytes, tail: tuple[int, ...], position: int,
              fill: Callable[[int], None],
              usable: Callable[[Checkpoint], bool] | None = None) -> Checkpoint | None:
        """Take a checkpoint slot (retiring one when at capacity), `fill` it, list it.
        None without capacity; a failed fill gives the slot back and re-raises."""
        if self.capacity < 1:
            return None
        if len(self) >= self.capacity and self.evict(1, usable) == 0:
            return None
        try:
            slot = self.states.allocate()
        except PoolExhausted:
            return None
        try:
            fill(slot)
        except Exception:
            self.states.release(slot)
            self.stats.failed += 1
            raise
        ckpt = Checkpoint(slot, parent, tail, position, next(self._clock))
        self._by_parent.setdefault(parent, {})[tail] = ckpt
        self._count += 1
        self.stats.published += 1
        return ckpt

    # ---- lookup -------------------------------------------------------------------------

    def find(self, tokens: list[int], chain: list[bytes], limit: int) -> Checkpoint | None:
        """The checkpoint at the largest position <= `limit` whose tokens are a prefix of
        `tokens`, among the page depths of `chain`; touches it (LRU).

        Args:
            tokens: the request's token ids.
            chain: chained keys of the request's cached full pages, root first:
                `chain[d]` keys pages [0, d); the caller has checked those pages are cached.
            limit: most positions the caller can back with cached KV (and at most
                len(tokens) - 1).
        """
        ps = self.page_size
        for depth in range(len(chain) - 1, -1, -1):
            base = depth * ps
            if base > limit:
                continue
            bucket = self._by_parent.get(chain[depth])
            if not bucket:
                continue
            best = None
            for tail, ckpt in bucket.items():
                if (ckpt.position <= limit and tuple(tokens[base:ckpt.position]) == tail
                        and (best is None or ckpt.position > best.position)):
                    best = ckpt
            if best is not None:
                best.last_used = next(self._clock)
                return best
        return None

    def along(self, tokens: list[int], chain: list[bytes], limit: int) -> list[Checkpoint]:
        """Every checkpoint at a position <= `limit` whose tokens are a prefix of `tokens`,
        among the page depths of `chain` (as for `find`), by position; not touched. A
        session save writes them all, so that a resent conversation whose tokens differ
        past any of them still restores the newest one before the difference."""
        ps, out = self.page_size, []
        for depth, parent in enumerate(chain):
            base = depth * ps
            if base > limit:
                break
            for tail, ckpt in self._by_parent.get(parent, {}).items():
                if ckpt.position <= limit and tuple(tokens[base:ckpt.position]) == tail:
                    out.append(ckpt)
        return sorted(out, key=lambda c: c.position)

    def pin(self, ckpt: Checkpoint) -> None:
        ckpt.pins += 1

    def unpin(self, ckpt: Checkpoint) -> None:
        assert ckpt.pins > 0, "unpin of an unpinned checkpoint"
        ckpt.pins -= 1

    # ---- retire -------------------------------------------------------------------------

    def evict(self, n: int, usable: Callable[[Checkpoint], bool] | None = None) -> int:
        """Retire up to `n` unpinned checkpoints: those `usable` says are no longer usable
        (their KV pages left the prefix index) first, then least recently used. Their slots
        go back to the pool. Returns how many were retired."""
        victims = [c for c in self.entries() if c.pins == 0]
        victims.sort(key=lambda c: (usable(c) if usable is not None else True, c.last_used))
        for ckpt in victims[:n]:
            if self.on_evict is not None:
                try:
                    self.on_evict(ckpt)
                except Exception:  # a lost copy costs a recompute later, never the eviction
                    log.exception("demotion of a retired checkpoint failed")
            self._remove(ckpt)
        self.stats.evicted += min(n, len(victims))
        return min(n, len(victims))

    def clear(self) -> int:
        """Retire every unpinned checkpoint; returns how many."""
        return self.evict(self._count)

    def _remove(self, ckpt: Checkpoint) -> None:
        bucket = self._by_parent[ckpt.parent]
        del bucket[ckpt.tail]
        if not bucket:
            del self._by_parent[ckpt.parent]
        self._count -= 1
        self.states.release(ckpt.slot)

    def check_integrity(self) -> None:
        """Assert: at most `capacity` checkpoints; each owns a distinct allocated slot; keys
        agree with positions; pins are not negative.

        Raises:
            AssertionError: naming the first problem.
        """
        seen: set[int] = set()
        entries = self.entries()
        assert len(entries) == self._count, "checkpoint count out of step"
        assert len(entries) <= self.capacity, f"{len(entries)} checkpoints > {self.capacity}"
        for c in entries:
            assert c.slot not in seen, f"state slot {c.slot} owned by two checkpoints"
            seen.add(c.slot)
            assert self.states.is_allocated(c.slot), f"checkpoint slot {c.slot} is free"
            assert c.pins >= 0
            assert c.position == (c.position // self.page_size) * self.page_size + len(c.tail)
            assert self._by_parent[c.parent][c.tail] is c
