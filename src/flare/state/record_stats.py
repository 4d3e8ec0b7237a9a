"""Counters every tier below the host keeps for its records (the disk tier, the Redis
remote tier): writes, reads and records rejected whole, by reason."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flare.state.disk_records import REASONS


@dataclass
class RecordTierStats:
    """Record counters since the tier was opened (all monotonic).

    `rejected_*` count records rejected whole, by reason (see `disk_records.REASONS`):
    checksum (a digest or the magic differs), truncated (shorter than its header says),
    namespace, version, layout (not ours), missing (indexed, no bytes), malformed (a
    header that passed its digest but does not decode, or trailing bytes), io (a read
    error).
    """

    written: int = 0
    write_failures: int = 0  # the store failed while writing; nothing was indexed
    refused: int = 0  # a record alone larger than the budget
    touched: int = 0  # put of a key already stored: no rewrite
    read_hits: int = 0
    read_misses: int = 0  # get of a key not offered (or evicted meanwhile)
    evicted: int = 0
    removed: int = 0
    rejected_checksum: int = 0
    rejected_truncated: int = 0
    rejected_namespace: int = 0
    rejected_version: int = 0
    rejected_layout: int = 0
    rejected_missing: int = 0
    rejected_malformed: int = 0
    rejected_io: int = 0

    def count_rejected(self, reason: str) -> None:
        """One more record rejected for `reason` (one of `disk_records.REASONS`).

        Raises:
            ValueError: an unknown reason.
        """
        if reason not in REASONS:
            raise ValueError(f"rejection reason {reason!r} is not one of {REASONS}")
        name = f"rejected_{reason}"
        setattr(self, name, getattr(self, name) + 1)

    def named(self, tier: str) -> dict[str, int]:
        """Flat counters for /metrics: `<tier>_tier_<field>_total`."""
        return {f"{tier}_tier_{k}_total": v for k, v in asdict(self).items()}
