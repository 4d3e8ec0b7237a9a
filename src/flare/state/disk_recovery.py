"""Keeping a disk tier folder sound: its lock, the debris of a crash cleaned up at open,
a damaged index rebuilt from the record files, rejected files moved aside into
rejected/, and a check of the invariants (`check_integrity`).

Crash safety. `DiskTier.put` writes a temporary file, flushes and fsyncs it, renames it
over the record name (atomic), fsyncs the folder, and only then inserts the index row;
eviction deletes the row before the file. So after a crash at any instant, every indexed
row names a whole file, and the only debris is a temporary file or a record file without
a row. Opening the tier deletes both (`_recover`; a record without a row is lost, not
re-indexed: it is a cache entry, and re-indexing would mean reading every such file at
start-up).

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

`DiskRecovery` is a base of `flare.state.disk_tier.DiskTier` (its folder, locks and
counters), over the row operations of `flare.state.disk_rows.DiskRows`.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import sqlite3
import time
from pathlib import Path

from flare.state import disk_records as rec
from flare.state.disk_index import INDEX_NAME, Row, open_index
from flare.state.disk_records import RecordError
from flare.state.disk_rows import DiskRows, unlink

REJECTED_KEEP = 32  # rejected files kept in rejected/ (oldest deleted first)

log = logging.getLogger(__name__)


class DiskRecovery(DiskRows):
    """Rejections, index rebuild, crash clean-up and the integrity check of
    `flare.state.disk_tier.DiskTier` (module docstring)."""

    def _reject(self, row: Row, reason: str, ident: tuple[int, int] | None) -> None:
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

    def _reject_locked(self, row: Row, reason: str) -> None:
        """Drop the row, count the reason, move the file (if any) to rejected/."""
        self._forget(row)
        self.stats.count_rejected(reason)
        if reason != "missing":
            self._move_aside(self.folder / row.file, reason)

    def _move_aside(self, path: Path, reason: str) -> None:
        try:
            os.replace(path, self._rejected / f"{path.name}.{reason}")
        except OSError:
            unlink(path)  # it must leave the record names either way
        kept = sorted(self._rejected.iterdir(), key=lambda p: p.stat().st_mtime_ns)
        for old in kept[:-REJECTED_KEEP]:
            unlink(old)

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
        self._db = open_index(self.folder)
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
                    self.stats.count_rejected(reason)
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
                unlink(Path(e.path))
                self.stats.temp_deleted += 1
            elif e.is_file() and e.name.endswith(".rec"):
                files[e.name] = e.stat().st_size
        rows = self._db.execute("SELECT namespace, key, file, nbytes, format_version, "
                                "last_used FROM records").fetchall()
        last = -1
        with self._lock:
            for r in rows:
                row, size, last = Row.of(r), files.pop(r[2], None), max(last, r[5])
                self._nbytes += row.nbytes  # _reject_locked takes it off again
                if size is None:
                    self._reject_locked(row, "missing")
                elif size != row.nbytes:  # of any namespace: such a file is no record
                    self._reject_locked(row, "truncated" if size < row.nbytes
                                        else "malformed")
            for name in files:  # renamed, never indexed (or its row was evicted)
                unlink(self.folder / name)
                self.stats.orphans_deleted += 1
            self._clock = itertools.count(last + 1)
            self._make_room(0)
            self._offered = {bytes(k) for (k,) in self._db.execute(
                "SELECT key FROM records WHERE namespace=? AND format_version=?",
                self._ours())}
        os.fsync(self._dir_fd)


def lock_folder(folder: Path) -> int:
    """Take an exclusive flock on <folder>/lock; the kernel drops it when the process
    dies, so a crashed writer never blocks a restart. Returns the lock's fd.

    Raises:
        RuntimeError: another process holds the folder.
    """
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RuntimeError(f"disk tier folder {folder} is in use by another process") from None
    return fd
