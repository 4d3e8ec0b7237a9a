"""The host tier: state records in CPU memory below the device pools, within a byte
budget from the capacity plan; least recently used records leave first (to the disk
tier, `flare.state.tiers.TierStore`, or dropped without one)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flare.state.disk_records import StateRecord


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

    def get(self, key: bytes) -> StateRecord | None:
        """The record under `key` (touched: most recently used), or None."""
        rec = self._records.get(key)
        if rec is not None:
            self._records.move_to_end(key)
        return rec

    def put(self, record: StateRecord) -> list[StateRecord]:
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

    def children(self, parent: bytes, kind: str) -> list[StateRecord]:
        """Records of `kind` ("tail" or "checkpoint") filed under `parent`."""
        return [self._records[k] for k in self._children.get((parent, kind), ())]

    def _pop_oldest(self) -> StateRecord:
        key, rec = self._records.popitem(last=False)
        kids = self._children[(rec.parent, rec.kind)]
        kids.discard(key)
        if not kids:
            del self._children[(rec.parent, rec.kind)]
        self.nbytes -= rec.nbytes
        self.evicted += 1
        return rec

    def drain(self) -> list[StateRecord]:
        """Remove and return every record, least recently used first."""
        return [self._pop_oldest() for _ in range(len(self._records))]
