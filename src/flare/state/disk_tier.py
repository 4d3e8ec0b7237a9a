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
                                             newest `REJECTED_KEEP`)
    <folder>/lock                            flock: one DiskTier per folder at a time

Crash safety. `put` writes a temporary file, flushes and fsyncs it, renames it over the
record name (atomic), fsyncs the folder, and only then inserts the index row; eviction
deletes the row before the file. So after a crash at any instant, every indexed row names
a whole file, and the only debris is a temporary file or a record file without a row.
Opening the tier deletes both (a record without a row is lost, not re-indexed: it is a
cache entry, and re-indexing would mean reading every such file at start-up).

A damaged index. When the index cannot be read at open (SQLite reports a malformed or
foreign file: `sqlite3.DatabaseError`, or `PRAGMA quick_check` is not "ok"), the tier does
not fail: it moves `index.sqlite` (and its `-wal` / `-shm` files) aside into rejected/
(`index.sqlite.<UTC time>.damaged`), creates an empty index and rebuilds it from the record
files (`_rebuild_index`): each file named for this namespace is read and verified whole,
as `get` verifies it, and indexed when it passes; one that fails is moved to rejected/
and counted by its reason; another namespace's files cannot be verified without that
package's layout and are dropped as orphans. The outcome is logged (kept, rejected,
dropped) and counted (`index_rebuilds`). The LRU order is rebuilt from the files' mtimes.
An `OperationalError` (locked, unwritable, out of space) is not damage and still raises.

Namespaces and versions. Rows of another namespace (package) or format version are never
offered (`contains`, `children`, `keys`, `get` ignore them) and are left on disk, but
they count against the budget and are evicted first: this process can never use them.

Threads. One lock guards the index and counters; `put`s are serialized by a second lock.
A `get` reads and verifies its file without holding either, so a transfer worker can read
while the engine thread writes; eviction may unlink a file a reader has open (POSIX keeps
it readable).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import sqlite3
import struct
import logging
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flare.state import disk_records as rec
from flare.state.disk_records import KINDS, RecordError, StateRecord

__all__ = ["DiskTier", "DiskTierStats", "StateRecord", "REJECTED_KEEP"]

REJECTED_KEEP = 32  # rejected files kept in rejected/ (oldest deleted first)
INDEX_NAME = "index.sqlite"

log = logging.getLogger(__name__)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    namespace TEXT NOT NULL,
    key BLOB NOT NULL,
    kind TEXT NOT NULL,
    parent BLOB NOT NULL,
    tokens BLOB NOT NULL,            -- int64 little-endian token ids
    position INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,         -- the file's exact length
    format_version INTEGER NOT NULL,
    file TEXT NOT NULL,              -- name inside the folder
    last_used INTEGER NOT NULL,      -- LRU clock (a counter, not wall time)
    PRIMARY KEY (namespace, key)
);
CREATE INDEX IF NOT EXISTS records_parent ON records (namespace, parent, kind);
CREATE INDEX IF NOT EXISTS records_lru ON records (last_used);
"""
_ROW_SQL = "SELECT namespace, key, file, nbytes, format_version FROM records"


@dataclass
class DiskTierStats:
    """Counters since this DiskTier was opened (all monotonic; `as_stats` names them).

    `rejected_*` count records rejected whole, by reason (see `disk_records.REASONS`):
    checksum (a digest or the magic differs), truncated (shorter than its header says),
    namespace, version, layout (not ours), missing (indexed, no file), malformed (a header
    that passed its digest but does not decode, or trailing bytes), io (a read error).
    """

    written: int = 0
    write_failures: int = 0  # OSError / SQLite error while writing; nothing was indexed
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
    temp_deleted: int = 0  # leftover temporary files deleted on open
    orphans_deleted: int = 0  # record files without a row deleted on open
    index_rebuilds: int = 0  # a damaged index moved aside and rebuilt from the files

    def as_stats(self) -> dict[str, int]:
        """Flat counters for /metrics: `disk_tier_<field>_total`."""
        return {f"disk_tier_{k}_total": v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class _Row:
    namespace: str
    key: bytes
    file: str
    nbytes: int
    format_version: int

    @classmethod
    def of(cls, r: tuple) -> _Row:
        return cls(r[0], bytes(r[1]), r[2], r[3], r[4])


class DiskTier:
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
        self._lock_fd = _lock_folder(self.folder)
        self._dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        self._nbytes = 0
        self._clock = itertools.count()
        # keys of the offered rows, kept beside the index so the engine thread can ask
        # without waiting for the lock a writer holds through its fsyncs (`offered`)
        self._offered: set[bytes] = set()
        self._db: sqlite3.Connection | None = None
        try:
            self._db = self._open_index(check=True)
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
        return [(bytes(k), _unpack_tokens(t), p) for k, t, p in rows]

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

    def check_integrity(self) -> None:
        """Assert the tier's invariants (stats every file: for tests and debugging).

        Raises:
            AssertionError: bytes over budget, a byte count that differs from the rows,
                a row without its file or with a file of another length, a temporary file
                or a record file without a row.
        """
        with self._lock:
            rows = self._db.execute("SELECT file, nbytes FROM records").fetchall()
            names = {e.name: e.stat().st_size for e in os.scandir(self.folder)
                     if e.is_file() and e.name.endswith((".rec", ".tmp"))}
            assert self._nbytes <= self.budget_bytes, "record bytes over the budget"
            assert self._nbytes == sum(n for _, n in rows), "byte count differs from rows"
            for file, nbytes in rows:
                assert names.get(file) == nbytes, f"{file}: file size {names.get(file)}"
            assert set(names) == {f for f, _ in rows}, "a file without a row"

    # ---- internals: index -------------------------------------------------------------------

    def _ours(self) -> tuple[str, int]:
        return self.namespace, self.format_version

    def _row(self, key: bytes, any_version: bool = False) -> _Row | None:
        """The offered row of `key`, or with `any_version` the row of our namespace that
        holds the key whatever its format version (caller holds the lock)."""
        self._check_open()
        if any_version:
            r = self._db.execute(_ROW_SQL + " WHERE namespace=? AND key=?",
                                 (self.namespace, key)).fetchone()
        else:
            r = self._db.execute(_ROW_SQL + " WHERE namespace=? AND key=? AND "
                                 "format_version=?",
                                 (self.namespace, key, self.format_version)).fetchone()
        return _Row.of(r) if r else None

    def _touch(self, key: bytes) -> None:
        self._check_open()
        self._db.execute("UPDATE records SET last_used=? WHERE namespace=? AND key=?",
                         (next(self._clock), self.namespace, key))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk tier is closed")

    def _delete_rows(self, rows: list[_Row]) -> None:
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
            _unlink(self.folder / r.file)

    def _forget(self, row: _Row) -> None:
        """Delete a row whose file is gone or handled by the caller."""
        self._db.execute("DELETE FROM records WHERE namespace=? AND key=?",
                         (row.namespace, row.key))
        self._nbytes -= row.nbytes
        if row.namespace == self.namespace:
            self._offered.discard(row.key)

    def _make_room(self, nbytes: int) -> None:
        """Evict until `nbytes` more fit: other namespaces' and versions' rows first, then
        ours, least recently used first (caller holds the lock)."""
        need = self._nbytes + nbytes - self.budget_bytes
        if need <= 0:
            return
        victims, freed = [], 0
        cursor = self._db.execute(
            _ROW_SQL + " ORDER BY (namespace=? AND format_version=?), last_used",
            self._ours())
        for r in cursor:
            if freed >= need:
                break
            victims.append(_Row.of(r))
            freed += r[3]
        cursor.close()
        self._delete_rows(victims)
        self.stats.evicted += len(victims)

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
                    _unlink(self.folder / name)
            return False
        finally:
            if tmp is not None and not renamed:
                _unlink(Path(tmp))

    def _insert(self, record: StateRecord, name: str, nbytes: int) -> None:
        self._db.execute(
            "INSERT INTO records (namespace, key, kind, parent, tokens, position, nbytes, "
            "format_version, file, last_used) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (self.namespace, record.key, record.kind, record.parent,
             _pack_tokens(record.tokens), record.position, nbytes, self.format_version,
             name, next(self._clock)))
        self._nbytes += nbytes
        self._offered.add(record.key)
        self.stats.written += 1

    def _reject(self, row: _Row, reason: str, ident: tuple[int, int] | None) -> None:
        """Reject a record a reader failed on, unless its row was evicted or its file
        replaced meanwhile (then it is a plain miss). `ident` is the (st_dev, st_ino) of
        the file the reader opened, None when it could not open it."""
        with self._lock:
            if self._row(row.key) != row:
                self.stats.read_misses += 1
                return
            try:
                st = os.stat(self.folder / row.file)
            except FileNotFoundError:
                reason = "missing"
            else:
                if ident is not None and (st.st_dev, st.st_ino) != ident:
                    self.stats.read_misses += 1
                    return
            self._reject_locked(row, reason)

    def _reject_locked(self, row: _Row, reason: str) -> None:
        """Drop the row, count the reason, move the file (if any) to rejected/."""
        self._forget(row)
        name = f"rejected_{reason}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)
        if reason != "missing":
            self._move_aside(self.folder / row.file, reason)

    def _move_aside(self, path: Path, reason: str) -> None:
        try:
            os.replace(path, self._rejected / f"{path.name}.{reason}")
        except OSError:
            _unlink(path)  # it must leave the record names either way
        kept = sorted(self._rejected.iterdir(), key=lambda p: p.stat().st_mtime_ns)
        for old in kept[:-REJECTED_KEEP]:
            _unlink(old)

    def _open_index(self, check: bool = False) -> sqlite3.Connection:
        """Connect to the index (created if missing) with the tier's settings.

        Raises:
            sqlite3.DatabaseError: the file is damaged (with `check`: also when
                `PRAGMA quick_check` finds damage), or cannot be opened.
        """
        db = sqlite3.connect(self.folder / INDEX_NAME, check_same_thread=False,
                             isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL: a commit survives a process crash; a power loss may lose the last
            # ones, which leaves files without rows (deleted on open) or rows without files
            # (dropped).
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            if check:
                verdict = db.execute("PRAGMA quick_check").fetchone()
                if not verdict or verdict[0] != "ok":
                    raise sqlite3.DatabaseError(f"quick_check: {verdict and verdict[0]}")
                db.execute("SELECT namespace, key, kind, parent, tokens, position, nbytes, "
                           "format_version, file, last_used FROM records").fetchall()
        except BaseException:
            db.close()
            raise
        return db

    def _rebuild_index(self, damage: sqlite3.DatabaseError) -> None:
        """Move a damaged index aside and index the verified record files of this
        namespace again (module docstring).

        Raises:
            sqlite3.DatabaseError: `damage` itself when it is an OperationalError (locked,
                unwritable: not damage), or the fresh index cannot be created either.
            OSError: the folder cannot be read or written.
        """
        if isinstance(damage, sqlite3.OperationalError):
            raise damage
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self._rejected / f"{INDEX_NAME}.{stamp}.damaged"
        for suffix in ("", "-wal", "-shm"):
            path = self.folder / f"{INDEX_NAME}{suffix}"
            if path.exists():
                os.replace(path, self._rejected / f"{aside.name}{suffix}")
        self._db = self._open_index()
        self.stats.index_rebuilds += 1
        ours = f".{self._tag}.rec"
        files = sorted((e.stat().st_mtime_ns, e.name) for e in os.scandir(self.folder)
                       if e.is_file() and e.name.endswith(ours))
        kept = rejected = 0
        with self._lock:
            for _, name in files:  # oldest first: the LRU clock follows the mtimes
                path = self.folder / name
                try:
                    key = bytes.fromhex(name.removesuffix(ours))
                    with open(path, "rb") as f:
                        size = os.fstat(f.fileno()).st_size
                        record = rec.read(f, size, self.namespace, self.layout, key,
                                          self.format_version)
                except (RecordError, ValueError, OSError) as e:
                    reason = e.reason if isinstance(e, RecordError) else (
                        "io" if isinstance(e, OSError) else "malformed")
                    field = f"rejected_{reason}"
                    setattr(self.stats, field, getattr(self.stats, field) + 1)
                    self._move_aside(path, reason)
                    rejected += 1
                    continue
                self._insert(record, name, size)
                kept += 1
            self.stats.written -= kept  # rebuilt rows, not writes
            self._nbytes = 0  # `_recover`, which runs next, counts every row
        dropped = sum(1 for e in os.scandir(self.folder)
                      if e.is_file() and e.name.endswith(".rec") and not e.name.endswith(ours))
        log.warning("disk tier index %s was damaged (%s); moved aside to %s and rebuilt from "
                    "the record files: %d kept, %d rejected (in %s), %d of other packages "
                    "dropped", self.folder / INDEX_NAME, damage, aside, kept, rejected,
                    self._rejected, dropped)

    def _recover(self) -> None:
        """Clean up after a crash or another run: delete temporary files and orphans, drop
        rows without files, reject records whose file has the wrong length, and evict
        down to the (maybe smaller) budget."""
        files: dict[str, int] = {}
        for e in os.scandir(self.folder):
            if e.is_file() and e.name.endswith(".tmp"):
                _unlink(Path(e.path))
                self.stats.temp_deleted += 1
            elif e.is_file() and e.name.endswith(".rec"):
                files[e.name] = e.stat().st_size
        rows = self._db.execute("SELECT namespace, key, file, nbytes, format_version, "
                                "last_used FROM records").fetchall()
        last = -1
        with self._lock:
            for r in rows:
                row, size, last = _Row.of(r), files.pop(r[2], None), max(last, r[5])
                self._nbytes += row.nbytes  # _reject_locked takes it off again
                if size is None:
                    self._reject_locked(row, "missing")
                elif size != row.nbytes:  # of any namespace: such a file is no record
                    self._reject_locked(row, "truncated" if size < row.nbytes
                                        else "malformed")
            for name in files:  # renamed, never indexed (or its row was evicted)
                _unlink(self.folder / name)
                self.stats.orphans_deleted += 1
            self._clock = itertools.count(last + 1)
            self._make_room(0)
            self._offered = {bytes(k) for (k,) in self._db.execute(
                "SELECT key FROM records WHERE namespace=? AND format_version=?",
                self._ours())}
        os.fsync(self._dir_fd)


def _lock_folder(folder: Path) -> int:
    """Take an exclusive flock on <folder>/lock; the kernel drops it when the process
    dies, so a crashed writer never blocks a restart."""
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RuntimeError(f"disk tier folder {folder} is in use by another process") from None
    return fd


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pack_tokens(tokens: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _unpack_tokens(blob: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(blob) // 8}q", blob)
