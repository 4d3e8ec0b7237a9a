"""Tiered state: a host tier and a disk tier below the device pools.

Device pool (the engine's KV pages and checkpoint slots) -> host tier (CPU memory, a byte
budget from the capacity plan) -> disk tier (`flare.state.disk_tier`, a folder with a byte
budget). States move down on eviction and up on reuse:

- demote: when the prefix index evicts a page, or the checkpoint index retires a
  checkpoint, a copy of it becomes a `StateRecord` in the host tier; when the host tier
  runs over its budget, its least recently used records are written to disk by the
  transfer worker (`flare.state.transfer`), or dropped when there is no disk tier;
- promote (`TierStore.promote`, called by admission before the device lookup): the
  request's token chain is followed past what the device holds, through host and disk
  records; if the restore is worth its cost, device pages (and a checkpoint slot) are
  taken, filled and published in the device indexes, and the device lookup adopts them as
  it adopts any cached prefix.

Records are keyed like the prefix index (chained BLAKE2b keys rooted in the package id),
so a key made by one package is never found by another, and keys survive a restart:
after one, the disk tier's index offers the records again and promotion finds them.

Write-through (on by default with a disk tier; `flare serve --no-write-through` turns it
off): each record a demotion keeps is also queued for disk, and so is, when a sequence
finishes, every part of its chain the disk tier lacks (`write_through`: pages, tail, and
for hybrids every checkpoint along it). The copy out of the device pools happens on the
engine thread between steps (a record is a snapshot); encoding, writing and fsyncs run
on the transfer worker. So the disk tier holds the recent working set, chain heads
included, and a process killed at any moment restarts with it, minus what the worker had
not written yet; each record is whole or absent (`flare.state.disk_tier`).

All or nothing: a restore reads every record it needs first; each is verified whole by
its tier. KV pages are usable at any page boundary, so a chain cut short by a missing or
rejected record still restores a correct, shorter prefix. A hybrid layer state is usable
only with all the KV pages below its position: it is promoted last, only when every page
it needs is in place, and the device lookup adopts it only together with those pages.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from flare.state.admission import Outcome
from flare.state.prefix_index import common_prefix, page_key

if TYPE_CHECKING:
    from flare.state.admission import CostPolicy
    from flare.state.checkpoints import Checkpoint, CheckpointIndex
    from flare.state.disk_tier import DiskTier, StateRecord
    from flare.state.pools import KVCache
    from flare.state.prefix_index import PageNode, PrefixIndex
    from flare.state.slots import StateSlotPool
    from flare.state.transfer import Ticket, TransferQueue

log = logging.getLogger(__name__)

PAGE, TAIL, CHECKPOINT = "page", "tail", "checkpoint"
WRITE_BEHIND_BYTES = 256 << 20  # most record bytes write-through holds for a busy worker
MAX_TOUCHES = 1 << 16  # most stored keys waiting to be marked used


def _key(tag: bytes, parent: bytes, tokens: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(tag + parent, digest_size=16)
    h.update(array("i", tokens).tobytes())
    return h.digest()


def tail_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Key of a partly filled page of `tokens` under `parent` (BLAKE2b-128)."""
    return _key(b"tail", parent, tokens)


def checkpoint_key(parent: bytes, tail: tuple[int, ...]) -> bytes:
    """Key of a layer-state checkpoint at `parent`'s pages plus `tail` (BLAKE2b-128)."""
    return _key(b"ckpt", parent, tail)


def page_record(kv: "KVCache", node: "PageNode") -> "StateRecord":
    """A host copy of a published page: K and V of its positions in every KV layer,
    tensors `k`, `v` of shape [num_kv_layers, len(node.tokens), num_kv_heads, head_dim]."""
    from flare.state.disk_tier import StateRecord

    a, n = node.page * kv.page_size, len(node.tokens)
    kind = PAGE if node.key is not None else TAIL
    key = node.key if node.key is not None else tail_key(node.parent, node.tokens)
    tensors = {"k": kv.k[:, a:a + n].to("cpu", copy=True),
               "v": kv.v[:, a:a + n].to("cpu", copy=True)}
    # position 0: a page is placed by its key chain, not by a position
    return StateRecord(kind, key, node.parent, node.tokens, 0, tensors)


def checkpoint_record(states: "StateSlotPool", ckpt: "Checkpoint") -> "StateRecord":
    """A host copy of a checkpoint: every layer state at `ckpt.position` (`states.read`)."""
    from flare.state.disk_tier import StateRecord

    return StateRecord(CHECKPOINT, checkpoint_key(ckpt.parent, ckpt.tail), ckpt.parent,
                       ckpt.tail, ckpt.position, states.read(ckpt.slot))


class HostTier:
    """Records in CPU memory within `budget_bytes`, least recently used first out.

    Args:
        budget_bytes: most bytes of record tensors held (the plan's host-tier bytes).
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host tier budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._records: OrderedDict[bytes, StateRecord] = OrderedDict()
        self._children: dict[tuple[bytes, str], set[bytes]] = {}
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: bytes) -> bool:
        return key in self._records

    def get(self, key: bytes) -> "StateRecord | None":
        """The record under `key` (touched: most recently used), or None."""
        rec = self._records.get(key)
        if rec is not None:
            self._records.move_to_end(key)
        return rec

    def put(self, record: "StateRecord") -> list["StateRecord"]:
        """Hold `record` (a key already held is only touched). Returns the records pushed
        out to stay within the budget, least recently used first (the caller demotes them
        to disk); `record` itself when it alone exceeds the budget."""
        if record.key in self._records:
            self._records.move_to_end(record.key)
            return []
        size = record.nbytes
        if size > self.budget_bytes:
            return [record]
        out = []
        while self.nbytes + size > self.budget_bytes:
            out.append(self._pop_oldest())
        self._records[record.key] = record
        self._children.setdefault((record.parent, record.kind), set()).add(record.key)
        self.nbytes += size
        return out

    def children(self, parent: bytes, kind: str) -> list["StateRecord"]:
        """Records of `kind` ("tail" or "checkpoint") filed under `parent`."""
        return [self._records[k] for k in self._children.get((parent, kind), ())]

    def _pop_oldest(self) -> "StateRecord":
        key, rec = self._records.popitem(last=False)
        kids = self._children[(rec.parent, rec.kind)]
        kids.discard(key)
        if not kids:
            del self._children[(rec.parent, rec.kind)]
        self.nbytes -= rec.nbytes
        self.evicted += 1
        return rec

    def drain(self) -> list["StateRecord"]:
        """Remove and return every record, least recently used first."""
        return [self._pop_oldest() for _ in range(len(self._records))]


class SaveRefused(RuntimeError):
    """A state cannot be written to the disk tier now (too big for it, queue full)."""


@dataclass(frozen=True)
class _Part:
    """One record a restore needs: where it is and what it covers."""

    key: bytes
    kind: str
    parent: bytes
    tokens: tuple[int, ...]
    end: int  # token position after this part (the positions it lends end there)
    tier: str  # "host" or "disk"
    start: int = 0  # token position of its first token
    partial: bool = False  # a full page lending only its first end - start positions


class _ChainPart(NamedTuple):
    """One record of a finished chain that write-through may queue."""

    order: tuple[int, int]  # (page index, 1 for a checkpoint after its page)
    key: bytes
    make: Callable[[], "StateRecord"]  # the host copy, made only when it is queued
    nbytes: int  # estimated record bytes
    end: int  # token position after the positions it covers
    kind: str


@dataclass
class PromoteResult:
    """What `TierStore.promote` did for one lookup.

    Attributes:
        outcome: a rejection of the tier part (CostRejected / CapacityRejected /
            EnqueueRejected), or None when nothing was rejected.
        wait: a read ticket the request must wait for (disk records on their way).
        held: device pages the promotion holds until the device lookup has adopted them.
        promoted_tokens: positions made available in the device pool by this promotion.
        tier: "host" or "disk": the slowest tier the restore came from.
        matched_tokens: with a rejection: the positions the tier part would have added.
    """

    outcome: Outcome | None = None
    wait: "Ticket | None" = None
    held: tuple[int, ...] = ()
    promoted_tokens: int = 0
    tier: str | None = None
    matched_tokens: int = 0


@dataclass
class TierStats:
    """Counters (ints) of tier traffic."""

    demoted_records: int = 0
    promoted_records: int = 0
    restores_host: int = 0
    restores_disk: int = 0
    restored_tokens: int = 0
    restored_tokens_host: int = 0  # prompt tokens a restore from the host tier supplied
    restored_tokens_disk: int = 0
    dropped_records: int = 0  # pushed out of the host tier with no disk tier (or queue full)
    restore_failures: int = 0
    disk_index_errors: int = 0  # the disk tier's index could not be read for stats
    written_through: int = 0  # records queued for disk by write-through
    write_through_capped: int = 0  # chains cut short: the rest would not fit the budget


class TierStore:
    """The host and disk tiers of one engine, and promotion into its device pools.

    Args:
        index: the device prefix index (pages are published there on promotion).
        kv: the device KV cache.
        policy: the admission cost arm (transfer time vs prefill time).
        host_budget_bytes: the host tier's byte budget.
        disk: the disk tier, or None (then records leaving the host tier are dropped).
        transfers: the transfer queue over `disk` (None without a disk tier).
        checkpoints: hybrid recipes: the device checkpoint index.
        write_through: with a disk tier: every state leaving the device pool, and each
            finished sequence's chain (`write_through`), is also written to disk in the
            background, so a crash keeps the recent working set (`flare.state.tiers`
            module notes, "Write-through"); the attribute `write_through_on` may be set
            later (before the first step). Finished chains always go through to a shared
            tier below (the Redis remote tier, `share_finished`), demotions do not.

    All methods but the transfer worker's run on the engine thread.
    """

    def __init__(self, index: "PrefixIndex", kv: "KVCache", policy: "CostPolicy",
                 host_budget_bytes: int, disk: "DiskTier | None" = None,
                 transfers: "TransferQueue | None" = None,
                 checkpoints: "CheckpointIndex | None" = None,
                 write_through: bool = False) -> None:
        self.index, self.kv, self.policy = index, kv, policy
        self.host = HostTier(host_budget_bytes)
        self.disk, self.transfers, self.checkpoints = disk, transfers, checkpoints
        self.page_size = index.page_size
        self.stats = TierStats()
        self.write_through_on = write_through
        # the next replica's turn restores from Redis: every finish is shared there
        self.share_finished = getattr(disk, "tier_name", "disk") == "remote"
        # pushed out of the host tier (or written through), not yet handed to the worker
        self._outbox: dict[bytes, StateRecord] = {}
        self._touch: list[bytes] = []  # stored keys to mark used after those writes
        self._after: list[Callable[[], None]] = []  # run by the worker after those writes

    # ---- demote -------------------------------------------------------------------------

    def demote_page(self, node: "PageNode") -> None:
        """Keep a copy of a page the prefix index is evicting (its K/V is still intact)."""
        self.demote(page_record(self.kv, node))

    def demote_checkpoint(self, ckpt: "Checkpoint") -> None:
        """Keep a copy of a checkpoint the checkpoint index is retiring."""
        self.demote(checkpoint_record(self.checkpoints.states, ckpt))

    def demote(self, record: "StateRecord") -> None:
        """Put `record` in the host tier; what that pushes out is queued for disk (sent by
        `submit_writes`, once per engine step). With write-through, `record` itself is
        queued for disk too, unless the disk tier holds it already."""
        self.stats.demoted_records += 1
        if (self.write_through_on and self.transfers is not None
                and not self.disk.offered([record.key])):
            self._outbox[record.key] = record
        self._to_disk(self.host.put(record))

    def _to_disk(self, records: list["StateRecord"]) -> None:
        if self.transfers is None:
            self.stats.dropped_records += len(records)
            return
        for rec in records:
            self._outbox[rec.key] = rec

    def submit_writes(self, force: bool = False) -> None:
        """Hand the records pushed out of the host tier (and written through) since the
        last call to the transfer worker as one write ticket (a full queue drops them: a
        later recompute, never a wrong answer). Called by the engine after each step's
        scheduling and after its outputs.

        With write-through, while a write ticket is still pending the records wait here
        and join the next ticket (one write ticket in flight: reads never queue behind
        many writes, and a busy disk merges work instead of filling the queue), up to
        `WRITE_BEHIND_BYTES`, beyond which the oldest are dropped. `force`: send now
        (flush, shutdown)."""
        if not self._outbox and not self._touch and not self._after:
            return
        if self._writes_behind and not force and self.transfers.num_pending_writes:
            self._bound_outbox()
            return
        records, self._outbox = list(self._outbox.values()), {}
        touch, self._touch = self._touch, []
        after, self._after = self._after, []
        if self.transfers.write(records, touch=tuple(touch), after=tuple(after)) is None:
            self.stats.dropped_records += len(records)

    @property
    def _writes_behind(self) -> bool:
        return self.write_through_on or self.share_finished

    @property
    def writes_ready(self) -> bool:
        """Records wait for the worker and no write ticket is pending: the engine's idle
        loop steps once more to send them."""
        return bool(self._outbox or self._touch or self._after) \
            and self.transfers is not None \
            and not self.transfers.num_pending_writes

    def _bound_outbox(self) -> None:
        """Drop the oldest waiting records beyond `WRITE_BEHIND_BYTES` (counted as
        dropped), and the oldest touches (and completion callbacks) beyond `MAX_TOUCHES`."""
        size = sum(r.nbytes for r in self._outbox.values())
        while size > WRITE_BEHIND_BYTES and self._outbox:
            rec = self._outbox.pop(next(iter(self._outbox)))
            size -= rec.nbytes
            self.stats.dropped_records += 1
        del self._touch[:-MAX_TOUCHES]
        del self._after[:-MAX_TOUCHES]

    def flush(self, timeout: float = 60.0) -> int:
        """Write every host record to disk and wait for it (tests, shutdown). Returns the
        records handed to the disk tier (0 without one)."""
        if self.transfers is None:
            return 0
        drained = self.host.drain()
        self._to_disk(drained)
        self.submit_writes(force=True)
        self.transfers.wait_idle(timeout)
        return len(drained)

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

    def save(self, tokens: list[int]) -> tuple["Ticket | None", int]:
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

    def _page_record(self, key: bytes) -> tuple[bool, "StateRecord | None"]:
        """(found, record) of a full page: from the device or the host tier; (True, None)
        when only the disk tier holds it."""
        node = self.index.node(key)
        if node is not None:
            return True, page_record(self.kv, node)
        rec = self.host.get(key) or self._outbox.get(key)
        if rec is not None:
            return True, rec
        return self.disk is not None and self.disk.contains(key), None

    def _tail_record(self, parent: bytes, rest: tuple[int, ...]) -> "StateRecord | None":
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
                           reach: int) -> tuple[int, list["StateRecord"]]:
        """(largest position, records) of every checkpoint at a position <= `reach` along
        `chain` ((key, position of its pages' end) pairs, root first) whose tail tokens
        match: those of the device and of the host tier (or on their way to disk) as
        records, by position; those only the disk tier holds count for the position but
        need no record. (0, []) when there is none."""
        ckpts = self.checkpoints
        found: dict[bytes, "StateRecord | None"] = {}
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

    # ---- locate -------------------------------------------------------------------------

    def _tiers_of(self, keys: list[bytes]) -> list[str | None]:
        """The tier holding each key ("host", "disk" or None); the disk index is asked
        once for all keys not on the host."""
        tiers: list[str | None] = ["host" if k in self.host or k in self._outbox else None
                                   for k in keys]
        missing = [k for k, t in zip(keys, tiers) if t is None]
        if missing and self.disk is not None:
            on_disk = self.disk.contains_many(missing)
            tiers = [t or ("disk" if k in on_disk else None) for k, t in zip(keys, tiers)]
        return tiers

    def _children(self, parent: bytes, kind: str) -> list[tuple[bytes, tuple[int, ...], int, str]]:
        """(key, tokens, position, tier) of tail or checkpoint records under `parent`."""
        out = [(r.key, r.tokens, r.position, "host") for r in self.host.children(parent, kind)]
        seen = {k for k, *_ in out}
        if self.disk is not None:
            out += [(k, t, p, "disk") for k, t, p in self.disk.children(parent, kind)
                    if k not in seen]
        return out

    def _continuation(self, tokens: list[int], parent: bytes, pos: int,
                      limit: int) -> list[_Part]:
        """Full pages past position `pos` (after `parent`'s chain) held by a tier, then
        the tail record sharing the most tokens with the request."""
        ps, parts = self.page_size, []
        keys, chunks, prev = [], [], parent  # every full page up to `limit`, in order
        for start in range(pos, limit - ps + 1, ps):
            chunks.append(tuple(tokens[start:start + ps]))
            prev = page_key(prev, chunks[-1])
            keys.append(prev)
        for key, chunk, tier in zip(keys, chunks, self._tiers_of(keys)):
            if tier is None:
                break
            parts.append(_Part(key, PAGE, parent, chunk, pos + ps, tier, pos))
            parent, pos = key, pos + ps
        # the page after the chain: a tail, or a full page of another continuation (a
        # reply that re-tokenized differently) lending the positions it shares, as the
        # device index lends a partly matching child
        want = tokens[pos:min(pos + ps, limit)]
        best, best_n = None, 0
        for kind in (TAIL, PAGE):
            for key, tail, _, tier in self._children(parent, kind):
                n = common_prefix(tail, want)
                if n > best_n:
                    best = _Part(key, kind, parent, tail, pos + n, tier, pos,
                                 partial=kind == PAGE)
                    best_n = n
        if best is not None:
            parts.append(best)
        return parts

    def _checkpoint(self, tokens: list[int], chain: list[tuple[bytes, int]],
                    reach: int) -> _Part | None:
        """The tier checkpoint at the largest position <= `reach` along `chain` ((key,
        position of its pages' end) pairs, root first) whose tail tokens match."""
        for parent, base in reversed(chain):
            best = None
            for key, tail, position, tier in self._children(parent, CHECKPOINT):
                if (position <= reach and tuple(tokens[base:position]) == tail
                        and (best is None or position > best.end)):
                    best = _Part(key, CHECKPOINT, parent, tail, position, tier)
            if best is not None:
                return best
        return None

    # ---- promote ------------------------------------------------------------------------

    def promote(self, tokens: list[int], limit: int, waiter: str,
                ticket: "Ticket | None" = None) -> PromoteResult:
        """Bring the part of `tokens[:limit]`'s state that lies in the host or disk tier
        into the device pools, if that is worth its cost.

        Args:
            tokens: the request's token ids.
            limit: most positions to restore (len(tokens) - 1).
            waiter: the request id (held on a read ticket while disk records load).
            ticket: the completed read ticket this request waited for, if any.

        Returns:
            PromoteResult; the caller must release `held` pages once it has adopted them.
        """
        index, pool = self.index, self.index.pool
        match = index.match(tokens, limit)
        held = list(match.pages)
        pool.incref(held)  # the device prefix must outlive the evictions below
        try:
            return self._promote(tokens, limit, waiter, ticket, match, held)
        except Exception:
            log.exception("restore from the host/disk tier failed; recomputing instead")
            self.stats.restore_failures += 1
            pool.release(held)
            return PromoteResult()

    def _promote(self, tokens, limit, waiter, ticket, match, held) -> PromoteResult:
        index, pool, ps = self.index, self.index.pool, self.page_size
        chain = [index.root, *match.keys]
        start = len(match.pages) * ps
        parts = self._continuation(tokens, chain[-1], start, limit)
        page_parts = [p for p in parts if p.kind == PAGE and not p.partial]
        if self.checkpoints is not None:
            device = self.checkpoints.find(tokens, chain, match.num_tokens)
            have = device.position if device is not None else 0
            reach = parts[-1].end if parts else start
            pairs = [(k, i * ps) for i, k in enumerate(chain)]
            pairs += [(p.key, p.end) for p in page_parts]
            ckpt = self._checkpoint(tokens, pairs, reach)
            if ckpt is None or ckpt.end <= have:
                return self._done(held)
            # only the pages below the checkpoint, and the page holding its last positions
            full = ckpt.end // ps
            need = [p for p in page_parts if p.end <= full * ps]
            if ckpt.end % ps:
                cover = [p for p in parts if p.kind != CHECKPOINT and p.start == full * ps
                         and p.end >= ckpt.end]
                if not cover:
                    return self._done(held)
                need.append(cover[0])
            parts = need + [ckpt]
            gain = ckpt.end - have
        else:
            gain = (parts[-1].end if parts else start) - match.num_tokens
        if gain <= 0 or not parts:
            return self._done(held)
        tier = "disk" if any(p.tier == "disk" for p in parts) else "host"
        nbytes = sum(len(p.tokens) for p in parts if p.kind != CHECKPOINT) \
            * self.kv.layout.kv_bytes_per_token
        if self.checkpoints is not None:
            nbytes += self.checkpoints.states.bytes_per_slot
        # the tier below the host may be the shared Redis tier: its own measured speed
        speed = getattr(self.disk, "tier_name", "disk") if tier == "disk" else tier
        if not self.policy.admit(gain, nbytes, speed):
            return self._done(held, Outcome.COST_REJECTED, gain)
        records = self._gather(parts, ticket)
        missing = tuple(p.key for p in parts if p.key not in records)
        if missing and ticket is None:
            if self.transfers is None:
                return self._done(held)
            wait = self.transfers.read(missing, waiter)
            if wait is None:
                return self._done(held, Outcome.ENQUEUE_REJECTED, gain)
            pool.release(held)
            return PromoteResult(wait=wait, tier=tier)
        # a record the disk tier rejected (or lost) cuts the chain there
        usable = []
        for p in parts:
            if p.key not in records:
                break
            usable.append(p)
        if self.checkpoints is not None and (not usable or usable[-1].kind != CHECKPOINT):
            return self._done(held)  # no layer state: the KV pages alone are no state
        kv_parts = [p for p in usable if p.kind != CHECKPOINT]
        if len(kv_parts) > pool.num_free:
            index.evict(len(kv_parts) - pool.num_free)
        if len(kv_parts) > pool.num_free:
            return self._done(held, Outcome.CAPACITY_REJECTED, gain)
        promoted = self._install(usable, records, held)
        if self.checkpoints is not None and promoted < usable[-1].end:
            return self._done(held)
        self.stats.restored_tokens += gain
        if tier == "disk":
            self.stats.restores_disk += 1
            self.stats.restored_tokens_disk += gain
        else:
            self.stats.restores_host += 1
            self.stats.restored_tokens_host += gain
        return PromoteResult(held=tuple(held), promoted_tokens=gain, tier=tier)

    def _done(self, held: list[int], outcome: Outcome | None = None,
              matched: int = 0) -> PromoteResult:
        self.index.pool.release(held)
        return PromoteResult(outcome=outcome, matched_tokens=matched if outcome else 0)

    def _gather(self, parts: list[_Part], ticket: "Ticket | None") -> dict[bytes, "StateRecord"]:
        """Records for `parts`: those a completed read ticket brought (verified whole by
        the disk tier; they also join the host tier), then the host tier's and those
        still queued for disk."""
        out: dict[bytes, StateRecord] = {}
        if ticket is not None:
            out.update(ticket.records)
            for rec in ticket.records.values():
                self._keep_on_host(rec)
        pending = {r.key: r for r in self.transfers.pending_writes()} if self.transfers else {}
        for p in parts:
            if p.key not in out:
                rec = self.host.get(p.key) or self._outbox.get(p.key) or pending.get(p.key)
                if rec is not None:
                    out[p.key] = rec
        return out

    def _keep_on_host(self, record: "StateRecord") -> None:
        """A record read back from disk joins the host tier; what that pushes out goes to
        disk like any demotion (a record already there is only touched)."""
        self._to_disk(self.host.put(record))

    def _install(self, parts: list[_Part], records: dict[bytes, "StateRecord"],
                 held: list[int]) -> int:
        """Copy records into fresh device pages / a checkpoint slot and publish them,
        parents first. Returns the position up to which the device now holds them."""
        index, pool, kv = self.index, self.index.pool, self.kv
        reached = 0
        for p in parts:
            rec = records[p.key]
            self.stats.promoted_records += 1
            if p.kind == CHECKPOINT:
                if self.checkpoints.publish_state(rec.parent, rec.tokens, rec.position,
                                                  rec.tensors) is None:
                    return reached
                reached = p.end
                continue
            (page,) = pool.allocate(1)
            a, n = page * kv.page_size, len(rec.tokens)
            try:
                kv.k[:, a:a + n] = rec.tensors["k"].to(kv.k.device)
                kv.v[:, a:a + n] = rec.tensors["v"].to(kv.v.device)
            except Exception:
                pool.release([page])
                raise
            if p.kind == PAGE:
                _, page = index.publish_full(rec.parent, rec.tokens, page)
            else:
                index.publish_tail(rec.parent, rec.tokens, page)
            held.append(page)  # ours until the device lookup has adopted it
            reached = p.end
        return reached

    def close(self) -> None:
        """Finish queued transfers, then close the disk tier (engine shutdown)."""
        if self.transfers is not None:
            self.transfers.close()
        if self.disk is not None:
            self.disk.close()

    def as_stats(self) -> dict[str, int]:
        """Flat counters and gauges for /metrics."""
        s = self.stats
        out = {
            "host_tier_records": len(self.host),
            "host_tier_bytes": self.host.nbytes,
            "host_tier_budget_bytes": self.host.budget_bytes,
            "host_tier_evicted_total": self.host.evicted,
            "tier_demoted_records_total": s.demoted_records,
            "tier_promoted_records_total": s.promoted_records,
            "tier_restores_host_total": s.restores_host,
            "tier_restores_disk_total": s.restores_disk,
            "tier_restored_tokens_total": s.restored_tokens,
            "prompt_tokens_cached_host_total": s.restored_tokens_host,
            "prompt_tokens_cached_disk_total": s.restored_tokens_disk,
            "tier_dropped_records_total": s.dropped_records,
            "tier_restore_failures_total": s.restore_failures,
            "tier_written_through_records_total": s.written_through,
            "tier_write_through_capped_total": s.write_through_capped,
            # records waiting for the worker (a write ticket was still pending)
            "tier_writes_waiting_records": len(self._outbox),
        }
        if self.disk is not None:
            try:  # a damaged index must not fail every caller of stats (/metrics, the guard)
                name = getattr(self.disk, "tier_name", "disk")  # "remote": Redis
                out[f"{name}_tier_records"] = len(self.disk)
                out[f"{name}_tier_bytes"] = self.disk.nbytes
            except Exception:
                log.exception("disk tier index unreadable")
                self.stats.disk_index_errors += 1
            out |= self.disk.as_stats()
            out["disk_tier_index_errors_total"] = self.stats.disk_index_errors
        if self.transfers is not None:
            t = self.transfers.stats
            out |= {f"transfer_{k}_total": v for k, v in vars(t).items()}
            out["transfer_pending"] = self.transfers.num_pending
        return out

