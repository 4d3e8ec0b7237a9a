"""Disk tier of conversation state: record files under a byte budget, found by key.

The slowest tier (device -> host -> disk). It keeps state parts (KV pages, tails, hybrid
checkpoints; see `disk_records` for the file format) across restarts, so a conversation
can be restored after the server comes back, and it never lets a damaged, foreign or
half-written record through: `get` verifies a record whole or rejects it whole.

Folder layout:
    <folder>/<key hex>.<namespace tag>.rec   one record (tag: BLAKE2b-64 of the namespace,
                                             so two packages sharing the folder never
                                             collide; names never come from user input)
    <folder>/<record name>.<random>.tmp      a record being written (deleted on open)
    <folder>/index.sqlite                    the index (SQLite, WAL)
    <folder>/rejected/                       rejected files, kept for diagnosis (the
                                             newest `disk_recovery.REJECTED_KEEP`)
    <folder>/lock                            flock: one DiskTier per folder at a time

Crash safety and a damaged index: `flare.state.disk_recovery` (every indexed row names a
whole file; a damaged index is rebuilt from the verified files at open).

Namespaces and versions. Rows of another namespace (package) or format version are never
offered (`contains`, `children`, `keys`, `get` ignore them) and are left on disk, but
they count against the budget and are evicted first: this process can never use them.

Threads. One lock guards the index and counters; `put`s are serialized by a second lock.
A `get` reads and verifies its file without holding either, so a transfer worker can read
while the engine thread writes; eviction may unlink a file a reader has open (POSIX keeps
it readable).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sqlite3
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from flare.state import disk_records as rec
from flare.state.disk_index import open_index, unpack_tokens
from flare.state.disk_records import KINDS, RecordError, StateRecord
from flare.state.disk_recovery import DiskRecovery, lock_folder
from flare.state.disk_rows import unlink
from flare.state.record_stats import RecordTierStats

__all__ = ["DiskTier", "DiskTierStats", "StateRecord"]


@dataclass
class DiskTierStats(RecordTierStats):
    """`RecordTierStats` since this DiskTier was opened, and its folder's clean-ups at open
    (all monotonic; `as_stats` names them `disk_tier_<field>_total`)."""

    temp_deleted: int = 0  # leftover temporary files deleted on open
    orphans_deleted: int = 0  # record files without a row deleted on open
    index_rebuilds: int = 0  # a damaged index moved aside and rebuilt from the files

    def as_stats(self) -> dict[str, int]:
        """Flat counters for /metrics: `disk_tier_<field>_total`."""
        return self.named("disk")


class DiskTier(DiskRecovery):
    """Record files of one namespace and layout in `folder`, at most `budget_bytes` in all.

    Args:
        folder: the tier's folder (created if missing).
        namespace: the package id; only its records are offered.
        layout: the state layout as a string (e.g. JSON of `StateLayout.describe()`);
            a record written with another layout is rejected on read.
        budget_bytes: most bytes of record files in the folder (all namespaces).

    Raises:
        ValueError: budget_bytes < 0.
        RuntimeError: another process holds the folder.
        OSError, sqlite3.Error: the folder or the index cannot be opened.
    """

    def __init__(self, folder: str | Path, namespace: str, layout: str,
                 budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.folder = Path(folder)
        self.namespace = namespace
        self.layout = layout
        self.budget_bytes = budget_bytes
        # Read at open, not import, so a test can write with another version.
        self.format_version = rec.FORMAT_VERSION
        self.stats = DiskTierStats()
        self._tag = hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()
        self._lock = threading.Lock()  # index, counters, renames into the folder
        self._write_lock = threading.Lock()  # one put at a time (room is reserved for it)
        self._closed = False
        self._rejected = self.folder / "rejected"
        self._rejected.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_folder(self.folder)
        self._dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        self._nbytes = 0
        self._clock = itertools.count()
        # keys of the offered rows, kept beside the index so the engine thread can ask
        # without waiting for the lock a writer holds through its fsyncs (`offered`)
        self._offered: set[bytes] = set()
        self._db: sqlite3.Connection | None = None
        try:
            self._db = open_index(self.folder, check=True)
        except sqlite3.DatabaseError as exc:
            self._rebuild_index(exc)
        self._recover()

    # ---- queries ------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of all indexed record files in the folder (every namespace): the amount
        the budget bounds."""
        return self._nbytes

    def __len__(self) -> int:
        """Records offered (this namespace and format version)."""
        with self._lock:
            return self._db.execute(
                "SELECT COUNT(*) FROM records WHERE namespace=? AND format_version=?",
                self._ours()).fetchone()[0]

    def contains(self, key: bytes) -> bool:
        """Whether a record of `key` is offered (index only: `get` may still reject it)."""
        with self._lock:
            return self._row(key) is not None

    def contains_many(self, keys: list[bytes]) -> set[bytes]:
        """The keys of `keys` whose records are offered (index only), in one query per 500
        keys instead of one per key (a restore walks a chain of hundreds of pages)."""
        found: set[bytes] = set()
        with self._lock:
            self._check_open()
            for i in range(0, len(keys), 500):
                part = keys[i:i + 500]
                rows = self._db.execute(
                    "SELECT key FROM records WHERE namespace=? AND format_version=? AND "
                    f"key IN ({','.join('?' * len(part))})", (*self._ours(), *part)).fetchall()
                found.update(bytes(k) for (k,) in rows)
        return found

    def offered(self, keys: list[bytes]) -> set[bytes]:
        """The keys of `keys` whose records are offered, from an in-memory copy of the
        index's keys: never waits for the lock (a writer holds it through a rename and an
        fsync), so the engine thread can ask between two steps. A key evicted or written
        by a put running meanwhile may be answered either way."""
        offered = self._offered
        return {k for k in keys if k in offered}

    def touch_many(self, keys: list[bytes]) -> int:
        """Mark the offered records of `keys` used, in order (the last one becomes the
        most recently used), in one transaction. Keys not offered are skipped. Returns
        how many were touched.

        Raises:
            RuntimeError: the tier is closed.
        """
        with self._lock:
            self._check_open()
            mine = [k for k in keys if k in self._offered]
            if not mine:
                return 0
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany(
                    "UPDATE records SET last_used=? WHERE namespace=? AND key=?",
                    [(next(self._clock), self.namespace, k) for k in mine])
            return len(mine)

    def children(self, parent: bytes, kind: str) -> list[tuple[bytes, tuple[int, ...], int]]:
        """(key, tokens, position) of offered records of `kind` under `parent`, ordered by
        position then key. Index only; does not touch (LRU).

        Raises:
            ValueError: `kind` is not one of `KINDS`.
        """
        if kind not in KINDS:
            raise ValueError(f"record kind {kind!r} is not one of {KINDS}")
        with self._lock:
            rows = self._db.execute(
                "SELECT key, tokens, position FROM records WHERE namespace=? AND "
                "format_version=? AND parent=? AND kind=? ORDER BY position, key",
                (*self._ours(), parent, kind)).fetchall()
        return [(bytes(k), unpack_tokens(t), p) for k, t, p in rows]

    def keys(self, kind: str | None = None) -> list[bytes]:
        """Keys of offered records (of one kind, or all), least recently used first."""
        query = "SELECT key FROM records WHERE namespace=? AND format_version=?"
        args: tuple = self._ours()
        if kind is not None:
            query, args = query + " AND kind=?", (*args, kind)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY last_used", args).fetchall()
        return [bytes(k) for (k,) in rows]

    # ---- read ---------------------------------------------------------------------------

    def get(self, key: bytes) -> StateRecord | None:
        """Read and verify the record of `key`; touches it (LRU).

        Returns:
            The whole record (fresh CPU tensors), or None when none is offered or it was
            rejected: a record that fails any check is moved to rejected/, its row is
            deleted and `stats.rejected_<reason>` counts it. Never raises for a bad file.

        Raises:
            RuntimeError: the tier is closed (or was closed during the read).
        """
        with self._lock:
            row = self._row(key)
            if row is None:
                self.stats.read_misses += 1
                return None
        path = self.folder / row.file
        ident = None
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                ident = (st.st_dev, st.st_ino)
                record = rec.read(f, st.st_size, self.namespace, self.layout, key,
                                  self.format_version)
        except RecordError as e:
            self._reject(row, e.reason, ident)
            return None
        except OSError:
            self._reject(row, "io", ident)
            return None
        with self._lock:
            self._touch(row.key)
            self.stats.read_hits += 1
        return record

    # ---- write --------------------------------------------------------------------------

    def put(self, record: StateRecord) -> bool:
        """Store a record crash-safely, evicting least recently used records to fit.

        Blocks for a file write and two fsyncs: call it off the engine's step loop.

        Returns:
            True when the record is stored (or was already: then it is only touched);
            False when it alone exceeds the budget (`stats.refused`) or the write failed
            (`stats.write_failures`; nothing is indexed then).

        Raises:
            ValueError: a tensor dtype the format cannot store.
            RuntimeError: the tier is closed.
        """
        with self._write_lock:
            with self._lock:
                self._check_open()
                if self._row(record.key) is not None:
                    self._touch(record.key)
                    self.stats.touched += 1
                    return True
            encoded = rec.encode(record, self.namespace, self.layout, self.format_version)
            with self._lock:
                if encoded.nbytes > self.budget_bytes:
                    self.stats.refused += 1
                    return False
                other = self._row(record.key, any_version=True)  # another format's row
                if other is not None:
                    self._delete_rows([other])
                self._make_room(encoded.nbytes)
            return self._write(record, encoded)

    def remove(self, key: bytes) -> None:
        """Delete the record of `key` (row, then file); nothing happens when it is absent."""
        with self._lock:
            row = self._row(key)
            if row is not None:
                self._delete_rows([row])
                self.stats.removed += 1

    def close(self) -> None:
        """Close the index and release the folder (idempotent). Waits for a running put."""
        with self._write_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._db.close()
            os.close(self._dir_fd)
            os.close(self._lock_fd)  # releases the flock

    def as_stats(self) -> dict[str, int]:
        """`stats.as_stats()`: the counters as `disk_tier_<field>_total`."""
        return self.stats.as_stats()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals: files ---------------------------------------------------------------

    def _write(self, record: StateRecord, encoded: rec.EncodedRecord) -> bool:
        """Temp file, fsync, rename, fsync folder, then the row (caller holds the write
        lock and has made room)."""
        name = f"{record.key.hex()}.{self._tag}.rec"
        tmp, renamed = None, False
        try:
            fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=self.folder)
            with os.fdopen(fd, "wb") as f:
                rec.write(f, encoded)
                f.flush()
                os.fsync(f.fileno())
            with self._lock:
                os.replace(tmp, self.folder / name)
                renamed = True
                os.fsync(self._dir_fd)  # the rename is durable before the row exists
                self._insert(record, name, encoded.nbytes)
            return True
        except (OSError, sqlite3.Error):
            with self._lock:
                self.stats.write_failures += 1
                if renamed:  # renamed but not indexed: the file must not stay
                    unlink(self.folder / name)
            return False
        finally:
            if tmp is not None and not renamed:
                unlink(Path(tmp))
