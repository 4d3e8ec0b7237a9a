"""Promotion: bringing a request's state up from the host or disk tier into the device pools.

Called by admission before the device lookup (`TierStore.promote`): the request's token
chain is followed past what the device holds, through host and disk records; if the
restore is worth its cost, device pages (and a checkpoint slot) are taken, filled and
published in the device indexes, and the device lookup adopts them as it adopts any
cached prefix.

All or nothing: a restore reads every record it needs first; each is verified whole by
its tier. KV pages are usable at any page boundary, so a chain cut short by a missing or
rejected record still restores a correct, shorter prefix. A hybrid layer state is usable
only with all the KV pages below its position: it is promoted last, only when every page
it needs is in place, and the device lookup adopts it only together with those pages.

Mixed into `flare.state.tiers.TierStore` (its index, pools, tiers, transfer queue and
stats); engine thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flare.state.admission import Outcome
from flare.state.prefix_index import common_prefix, page_key
from flare.state.tier_records import CHECKPOINT, PAGE, TAIL

if TYPE_CHECKING:
    from flare.state.disk_records import StateRecord
    from flare.state.transfer import Ticket

log = logging.getLogger(__name__)


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
    wait: Ticket | None = None
    held: tuple[int, ...] = ()
    promoted_tokens: int = 0
    tier: str | None = None
    matched_tokens: int = 0


class Promotion:
    """Promotion into the device pools for `flare.state.tiers.TierStore` (module docstring)."""

    def promote(self, tokens: list[int], limit: int, waiter: str,
                ticket: Ticket | None = None) -> PromoteResult:
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

    def _gather(self, parts: list[_Part], ticket: Ticket | None) -> dict[bytes, StateRecord]:
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

    def _keep_on_host(self, record: StateRecord) -> None:
        """A record read back from disk joins the host tier; what that pushes out goes to
        disk like any demotion (a record already there is only touched)."""
        self._to_disk(self.host.put(record))

    def _install(self, parts: list[_Part], records: dict[bytes, StateRecord],
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
