"""Whole chains of state written to the tier below: write-through at each finish, and saves.

Write-through (on by default with a disk tier; `flare serve --no-write-through` turns it
off; always on toward the shared Redis tier): when a sequence finishes, every part of its
chain the tier below lacks (`write_through`: pages, tail, and for hybrids every
checkpoint along it) is queued for it, and with a disk tier so is each record a demotion
keeps (`TierStore.demote`). The copy out of the device pools happens on the engine thread
between steps (a record is a snapshot); encoding, writing and fsyncs run on the transfer
worker. So the disk tier holds the recent working set, chain heads included, and a
process killed at any moment restarts with it, minus what the worker had not written
yet; each record is whole or absent (`flare.state.disk_tier`). A named session's name is
marked saved once its chain is written (`write_through`'s `on_written`), so it comes back
by name after a crash too.

A save (`save`: `POST /v1/sessions/NAME/save`, an offload to disk, a shutdown save) writes
a chain from the device, the host tier or records on their way to disk, as one ticket.

Mixed into `flare.state.tiers.TierStore`: these methods use its index, pools, host and
disk tiers, transfer queue, outbox and stats; they run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from flare.state.prefix_index import page_key
from flare.state.tier_records import (
    CHECKPOINT,
    PAGE,
    TAIL,
    checkpoint_key,
    checkpoint_record,
    page_record,
    tail_key,
)

if TYPE_CHECKING:
    from flare.state.disk_records import StateRecord
    from flare.state.transfer import Ticket


class SaveRefused(RuntimeError):
    """A state cannot be written to the disk tier now (too big for it, queue full)."""


class _ChainPart(NamedTuple):
    """One record of a finished chain that write-through may queue."""

    order: tuple[int, int]  # (page index, 1 for a checkpoint after its page)
    key: bytes
    make: Callable[[], StateRecord]  # the host copy, made only when it is queued
    nbytes: int  # estimated record bytes
    end: int  # token position after the positions it covers
    kind: str


class ChainWrites:
    """Write-through and saves of `flare.state.tiers.TierStore` (module docstring)."""

    def write_through(self, tokens: list[int],
                      on_written: Callable[[int], object] | None = None) -> int:
        """Queue for disk, in the background, the state of `tokens` (a finished
        sequence's computed tokens) that the disk tier does not hold yet: its full pages
        and tail on the device, and, for hybrid recipes, every checkpoint along it (the
        prompt end and the token before it, the generation end, grid points). Sent with
        the step's other writes by `submit_writes`. With the Redis remote tier below
        (`share_finished`) this is how a finished request's state is shared: only the
        records Redis lacks are sent.

        `on_written`: called on the transfer worker once that write ticket is done, with
        the positions of `tokens` the tier below now holds whole (KV: the longest prefix
        of pages; hybrids: the largest checkpoint with every page below it; 0: none). A
        named session is marked saved there, so its name is durable only after its chain.
        Not called when the write is dropped (a full queue).

        Order: records by position, each checkpoint after the page holding its last
        position, so a crash part-way leaves the longest usable prefix; then the whole
        chain is touched deepest first, so the disk tier's least-recently-used eviction
        drops a conversation's end before the pages it hangs from. A chain larger than
        the disk budget is written only as far as it fits (it would otherwise evict its
        own beginning). Returns the records queued (0 without write-through)."""
        if not self._writes_behind or self.transfers is None:
            return 0
        parts = self._chain_parts(tokens)
        if not parts:
            return 0
        budget, total, fit = self.disk.budget_bytes, 0, []
        for part in parts:
            total += part.nbytes
            if total > budget * 0.9:  # room for the record headers
                self.stats.write_through_capped += 1
                break
            fit.append(part)
        keys = [p.key for p in fit]
        have = self.disk.offered(keys) | set(self._outbox)
        have |= {r.key for r in self.transfers.pending_writes()}
        queued = 0
        for part in fit:
            if part.key not in have:
                self._outbox[part.key] = part.make()
                queued += 1
        self._touch += keys[::-1]
        if on_written is not None:
            self._after.append(lambda: on_written(self._covered(fit)))
        self.stats.written_through += queued
        return queued

    def _covered(self, parts: list[_ChainPart]) -> int:
        """Positions the tier below holds whole of a chain's `parts` (in order): the end
        of the longest stored prefix of them, for hybrids its largest checkpoint."""
        stored, covered = self.disk.contains_many([p.key for p in parts]), 0
        for p in parts:
            if p.key not in stored:
                break
            if self.checkpoints is None or p.kind == CHECKPOINT:
                covered = max(covered, p.end)
        return covered

    def _chain_parts(self, tokens: list[int]) -> list[_ChainPart]:
        """Each part of `tokens`' state the device holds: full pages from the root while
        listed, the tail, the checkpoints along them; sorted by order (page index,
        checkpoints after their page)."""
        index, ps, kv = self.index, self.page_size, self.kv
        per_token = kv.layout.kv_bytes_per_token
        parent, pos, parts = index.root, 0, []
        chain = [index.root]
        while pos + ps <= len(tokens):
            node = index.node(page_key(parent, tuple(tokens[pos:pos + ps])))
            if node is None:
                break
            parts.append(_ChainPart((pos // ps, 0), node.key,
                                    lambda n=node: page_record(kv, n), ps * per_token,
                                    pos + ps, PAGE))
            parent, pos = node.key, pos + ps
            chain.append(parent)
        rest = tuple(tokens[pos:])
        node = index.tail_node(parent, rest) if rest else None
        if node is not None:
            pos += len(rest)
            parts.append(_ChainPart(((pos - len(rest)) // ps, 0), tail_key(parent, node.tokens),
                                    lambda n=node: page_record(kv, n),
                                    len(node.tokens) * per_token, pos, TAIL))
        ckpts = self.checkpoints
        if ckpts is not None:
            size = ckpts.states.bytes_per_slot
            for c in ckpts.along(tokens, chain, pos):
                parts.append(_ChainPart(((c.position - 1) // ps, 1),
                                        checkpoint_key(c.parent, c.tail),
                                        lambda c=c: checkpoint_record(ckpts.states, c), size,
                                        c.position, CHECKPOINT))
        parts.sort(key=lambda p: p.order)
        return parts

    def save(self, tokens: list[int]) -> tuple[Ticket | None, int]:
        """Write the state of `tokens` (its computed prefix: the caller passes the tokens
        whose K/V exist) to the disk tier: every full page and the tail along its chain,
        from the device, the host tier or records on their way to disk, plus, for hybrid
        recipes, every checkpoint along the chain (each prompt end and the token before
        it, each generation end, each grid point), so that after a restart a resent
        conversation whose tokens differ from `tokens` somewhere (a reply that
        re-tokenizes differently, an edit) restores the newest checkpoint at or below the
        first difference, as a server that never restarted does. Returns (write ticket,
        positions covered: the largest checkpoint's for hybrids); (None, 0) when there is
        no disk tier or nothing to save. Records the disk tier already holds are only
        touched by the write."""
        if self.transfers is None:
            return None, 0
        index, ps = self.index, self.page_size
        parent, pos, records = index.root, 0, []
        chain = [(parent, 0)]
        stored = self._shared_below(tokens)
        while pos + ps <= len(tokens):
            chunk = tuple(tokens[pos:pos + ps])
            key = page_key(parent, chunk)
            found, rec = (True, None) if key in stored else self._page_record(key)
            if not found:
                break
            if rec is not None:  # None: the disk tier holds it already
                records.append(rec)
            parent, pos = key, pos + ps
            chain.append((parent, pos))
        rest = tuple(tokens[pos:])
        tail = self._tail_record(parent, rest) if rest else None
        if tail is not None:
            records.append(tail)
            pos += len(rest)
        if self.checkpoints is not None:
            pos, ckpts = self._saved_checkpoints(tokens, chain, pos)
            if pos == 0:
                return None, 0  # KV pages without a layer state are no state
            records += ckpts
        if not records:
            return None, pos
        size = sum(r.nbytes for r in records)
        if size > self.disk.budget_bytes:
            raise SaveRefused(f"the state of {pos} tokens takes {size:,} bytes, more than the "
                              f"disk tier's budget of {self.disk.budget_bytes:,} bytes")
        # deepest first: the disk tier evicts least recently written first, so under
        # pressure it drops the ends of a chain before the pages they hang from
        ticket = self.transfers.write(records[::-1])
        if ticket is None:
            raise SaveRefused("the transfer queue is full; retry shortly")
        return ticket, pos

    def _shared_below(self, tokens: list[int]) -> set[bytes]:
        """Full-page keys of `tokens` a shared tier below (the Redis remote tier) holds
        already, touched there (LRU) in one call: a save copies none of them again. Empty
        for the disk tier, which touches on its own writes."""
        disk, ps = self.disk, self.page_size
        if getattr(disk, "tier_name", "disk") != "remote":
            return set()
        keys, parent = [], self.index.root
        for pos in range(0, len(tokens) - ps + 1, ps):
            parent = page_key(parent, tuple(tokens[pos:pos + ps]))
            keys.append(parent)
        stored = disk.contains_many(keys)
        disk.touch_many(stored)
        return stored

    def _page_record(self, key: bytes) -> tuple[bool, StateRecord | None]:
        """(found, record) of a full page: from the device or the host tier; (True, None)
        when only the disk tier holds it."""
        node = self.index.node(key)
        if node is not None:
            return True, page_record(self.kv, node)
        rec = self.host.get(key) or self._outbox.get(key)
        if rec is not None:
            return True, rec
        return self.disk is not None and self.disk.contains(key), None

    def _tail_record(self, parent: bytes, rest: tuple[int, ...]) -> StateRecord | None:
        """A record of a partly filled page under `parent` that starts with `rest`."""
        node = self.index.tail_node(parent, rest)
        if node is not None:
            return page_record(self.kv, node)
        n = len(rest)
        for rec in self.host.children(parent, TAIL):
            if rec.tokens[:n] == rest:
                return rec
        return None

    def _saved_checkpoints(self, tokens: list[int], chain: list[tuple[bytes, int]],
                           reach: int) -> tuple[int, list[StateRecord]]:
        """(largest position, records) of every checkpoint at a position <= `reach` along
        `chain` ((key, position of its pages' end) pairs, root first) whose tail tokens
        match: those of the device and of the host tier (or on their way to disk) as
        records, by position; those only the disk tier holds count for the position but
        need no record. (0, []) when there is none."""
        ckpts = self.checkpoints
        found: dict[bytes, StateRecord | None] = {}
        top = 0
        for ckpt in ckpts.along(tokens, [k for k, _ in chain], reach):
            found[checkpoint_key(ckpt.parent, ckpt.tail)] = checkpoint_record(ckpts.states,
                                                                              ckpt)
            top = max(top, ckpt.position)
        for parent, base in chain:
            if base > reach:
                break
            for key, tail, position, tier in self._children(parent, CHECKPOINT):
                if key in found or position > reach or tuple(tokens[base:position]) != tail:
                    continue
                rec = (self.host.get(key) or self._outbox.get(key)) if tier == "host" else None
                found[key] = rec
                top = max(top, position)
        records = sorted((r for r in found.values() if r is not None),
                         key=lambda r: r.position)
        return top, records
