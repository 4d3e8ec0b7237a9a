"""Tiered state: a host tier and a disk tier below the device pools.

Device pool (the engine's KV pages and checkpoint slots) -> host tier (CPU memory, a byte
budget from the capacity plan: `flare.state.host_tier`) -> disk tier
(`flare.state.disk_tier`, a folder with a byte budget; or the shared Redis tier,
`flare.state.remote_tier`). States move down on eviction and up on reuse:

- demote: when the prefix index evicts a page, or the checkpoint index retires a
  checkpoint, a copy of it (`flare.state.tier_records`) becomes a record in the host
  tier; when the host tier runs over its budget, its least recently used records are
  written to disk by the transfer worker (`flare.state.transfer`), or dropped when there
  is no disk tier;
- promote (`flare.state.promotion`): a request's chain is followed past what the device
  holds, through host and disk records, and restored when worth its cost;
- write through and save (`flare.state.chain_writes`): finished chains, and saved ones,
  are written to the tier below in the background.

Records are keyed like the prefix index, so keys survive a restart: after one, the disk
tier's index offers the records again and promotion finds them.

`TierStore` holds the tiers, the records waiting for the transfer worker (the outbox) and
the counters; its promotion and chain writes are mixed in from those modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flare.state.chain_writes import ChainWrites
from flare.state.host_tier import HostTier
from flare.state.promotion import Promotion
from flare.state.tier_records import checkpoint_record, page_record

if TYPE_CHECKING:
    from flare.state.admission import CostPolicy
    from flare.state.checkpoints import Checkpoint, CheckpointIndex
    from flare.state.disk_records import StateRecord
    from flare.state.disk_tier import DiskTier
    from flare.state.pools import KVCache
    from flare.state.prefix_index import PageNode, PrefixIndex
    from flare.state.transfer import TransferQueue

log = logging.getLogger(__name__)

WRITE_BEHIND_BYTES = 256 << 20  # most record bytes write-through holds for a busy worker
MAX_TOUCHES = 1 << 16  # most stored keys waiting to be marked used


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


class TierStore(Promotion, ChainWrites):
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
            background, so a crash keeps the recent working set
            (`flare.state.chain_writes`); the attribute `write_through_on` may be set
            later (before the first step). Finished chains always go through to a shared
            tier below (the Redis remote tier, `share_finished`), demotions do not.

    All methods but the transfer worker's run on the engine thread.
    """

    def __init__(self, index: PrefixIndex, kv: KVCache, policy: CostPolicy,
                 host_budget_bytes: int, disk: DiskTier | None = None,
                 transfers: TransferQueue | None = None,
                 checkpoints: CheckpointIndex | None = None,
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

    def demote_page(self, node: PageNode) -> None:
        """Keep a copy of a page the prefix index is evicting (its K/V is still intact)."""
        self.demote(page_record(self.kv, node))

    def demote_checkpoint(self, ckpt: Checkpoint) -> None:
        """Keep a copy of a checkpoint the checkpoint index is retiring."""
        self.demote(checkpoint_record(self.checkpoints.states, ckpt))

    def demote(self, record: StateRecord) -> None:
        """Put `record` in the host tier; what that pushes out is queued for disk (sent by
        `submit_writes`, once per engine step). With write-through, `record` itself is
        queued for disk too, unless the disk tier holds it already."""
        self.stats.demoted_records += 1
        if (self.write_through_on and self.transfers is not None
                and not self.disk.offered([record.key])):
            self._outbox[record.key] = record
        self._to_disk(self.host.put(record))

    def _to_disk(self, records: list[StateRecord]) -> None:
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
        `WRITE_BEHIND_BYTES`, beyond which the newest are dropped. `force`: send now
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
        """Drop the newest waiting records beyond `WRITE_BEHIND_BYTES` (counted as
        dropped), and the oldest touches (and completion callbacks) beyond `MAX_TOUCHES`.

        Newest first: a chain's records are queued head first, and a record is of use
        only with every record before it in its chain, so cutting from the newest end
        leaves each chain a restorable prefix (dropping the oldest would take the heads
        and orphan everything after them)."""
        size = sum(r.nbytes for r in self._outbox.values())
        while size > WRITE_BEHIND_BYTES and self._outbox:
            _, rec = self._outbox.popitem()  # the most recently queued
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
