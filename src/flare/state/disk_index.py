"""The disk tier's index: one SQLite table (WAL) of the record files in its folder.

A row per record file: its namespace, key, kind, parent, tokens, position, exact length,
format version, file name and an LRU clock (a counter, not wall time). The disk tier
(`flare.state.disk_tier`) inserts a row only after its file is durable and deletes the
row before the file, so every row names a whole file.
"""

from __future__ import annotations

import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path

INDEX_NAME = "index.sqlite"

SCHEMA = """
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
ROW_SQL = "SELECT namespace, key, file, nbytes, format_version FROM records"


@dataclass(frozen=True)
class Row:
    """The fields of an index row the tier acts on (`ROW_SQL`'s columns)."""

    namespace: str
    key: bytes
    file: str
    nbytes: int
    format_version: int

    @classmethod
    def of(cls, r: tuple) -> Row:
        return cls(r[0], bytes(r[1]), r[2], r[3], r[4])


def open_index(folder: Path, check: bool = False) -> sqlite3.Connection:
    """Connect to `folder`'s index (created if missing) with the tier's settings.

    Raises:
        sqlite3.DatabaseError: the file is damaged (with `check`: also when
            `PRAGMA quick_check` finds damage), or cannot be opened.
    """
    db = sqlite3.connect(folder / INDEX_NAME, check_same_thread=False,
                         isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit survives a process crash; a power loss may lose the last
        # ones, which leaves files without rows (deleted on open) or rows without files
        # (dropped).
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
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


def pack_tokens(tokens: tuple[int, ...]) -> bytes:
    """Token ids as the index stores them: int64 little-endian."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


def unpack_tokens(blob: bytes) -> tuple[int, ...]:
    """The token ids of a `pack_tokens` blob."""
    return struct.unpack(f"<{len(blob) // 8}q", blob)
