"""The disk tier's rows of one namespace: the index operations `DiskTier` and
`DiskRecovery` both act on (lookups, touches, deletes, eviction, inserts).

Every method expects the caller to hold `_lock`. Rows are deleted before their files, so
a crash in between leaves orphan files (deleted at open), never a row without its file.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
from pathlib import Path

from flare.state.disk_index import ROW_SQL, Row, pack_tokens
from flare.state.disk_records import StateRecord
from flare.state.record_stats import RecordTierStats


class DiskRows:
    """Index rows of `namespace` (and `format_version`) in `_db`, with the byte total and
    the offered keys kept beside it (`flare.state.disk_tier.DiskTier` sets them all)."""

    folder: Path
    namespace: str
    format_version: int
    budget_bytes: int
    stats: RecordTierStats
    _db: sqlite3.Connection
    _closed: bool
    _nbytes: int
    _clock: itertools.count
    _offered: set[bytes]

    def _ours(self) -> tuple[str, int]:
        return self.namespace, self.format_version

    def _row(self, key: bytes, any_version: bool = False) -> Row | None:
        """The offered row of `key`, or with `any_version` the row of our namespace that
        holds the key whatever its format version (caller holds the lock)."""
        self._check_open()
        if any_version:
            r = self._db.execute(ROW_SQL + " WHERE namespace=? AND key=?",
                                 (self.namespace, key)).fetchone()
        else:
            r = self._db.execute(ROW_SQL + " WHERE namespace=? AND key=? AND "
                                 "format_version=?",
                                 (self.namespace, key, self.format_version)).fetchone()
        return Row.of(r) if r else None

    def _touch(self, key: bytes) -> None:
        self._check_open()
        self._db.execute("UPDATE records SET last_used=? WHERE namespace=? AND key=?",
                         (next(self._clock), self.namespace, key))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk tier is closed")

    def _delete_rows(self, rows: list[Row]) -> None:
        """Delete rows, then their files (a crash in between leaves orphans, which open
        deletes: never a row without its file)."""
        if not rows:
            return
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM records WHERE namespace=? AND key=?",
                                 [(r.namespace, r.key) for r in rows])
        for r in rows:
            self._nbytes -= r.nbytes
            if r.namespace == self.namespace:
                self._offered.discard(r.key)
            unlink(self.folder / r.file)

    def _forget(self, row: Row) -> None:
        """Delete a row whose file is gone or handled by the caller."""
        self._db.execute("DELETE FROM records WHERE namespace=? AND key=?",
                         (row.namespace, row.key))
        self._nbytes -= row.nbytes
        if row.namespace == self.namespace:
            self._offered.discard(row.key)

    def _make_room(self, nbytes: int) -> None:
        """Evict until `nbytes` more fit: other namespaces' and versions' rows first, then
        ours, least recently used first, each with every record of ours that hangs from
        it (caller holds the lock).

        Touches keep a chain's head more recent than its end, but a write ticket that
        merged several chains writes heads first and touches only at its end, so a head
        can be the least recently used row. A record whose parent is gone cannot be
        restored after a restart (restores walk from the root), so it goes with it: the
        disk never keeps an end without the pages it hangs from."""
        need = self._nbytes + nbytes - self.budget_bytes
        if need <= 0:
            return
        victims: dict[tuple[str, bytes], Row] = {}
        freed = 0
        cursor = self._db.execute(
            ROW_SQL + " ORDER BY (namespace=? AND format_version=?), last_used",
            self._ours())
        for r in cursor:  # lazily: eviction stops as soon as enough is freed
            if freed >= need:
                break
            row = Row.of(r)
            if (row.namespace, row.key) in victims:
                continue
            for v in [row, *self._descendants(row)]:
                if (v.namespace, v.key) not in victims:
                    victims[(v.namespace, v.key)] = v
                    freed += v.nbytes
        cursor.close()
        self._delete_rows(list(victims.values()))
        self.stats.evicted += len(victims)

    def _descendants(self, row: Row) -> list[Row]:
        """Every row of `row`'s namespace whose parent chain runs through `row`."""
        found = self._db.execute(
            "WITH RECURSIVE below(key) AS (SELECT key FROM records WHERE namespace=?1 "
            "AND parent=?2 UNION SELECT r.key FROM records r JOIN below ON "
            "r.parent=below.key WHERE r.namespace=?1) "
            + ROW_SQL + " WHERE namespace=?1 AND key IN below",
            (row.namespace, row.key)).fetchall()
        return [Row.of(r) for r in found]

    def _insert(self, record: StateRecord, name: str, nbytes: int) -> None:
        self._db.execute(
            "INSERT INTO records (namespace, key, kind, parent, tokens, position, nbytes, "
            "format_version, file, last_used) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (self.namespace, record.key, record.kind, record.parent,
             pack_tokens(record.tokens), record.position, nbytes, self.format_version,
             name, next(self._clock)))
        self._nbytes += nbytes
        self._offered.add(record.key)
        self.stats.written += 1


def unlink(path: Path) -> None:
    """Delete `path`; nothing when it is already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
