"""Whole-file writes that a crash never leaves half done.

`write_text_atomic` writes a temporary file in the target's folder, flushes and fsyncs it,
and renames it over the target (atomic on POSIX: a reader, or a restart after a SIGKILL,
sees the old file or the new one, never a mix); with `durable` the folder is fsynced too,
so the rename itself survives a power loss. Used for the small JSON files Flare keeps
beside its states: saved session names (`flare.state.sessions`), stored Responses
(`flare.server.responses`) and `flare chat` conversations (`flare.chat.store`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace `path` with `text` (UTF-8) in one step.

    Args:
        path: the file; its folder must exist.
        text: the whole new content.
        durable: also fsync the folder after the rename.

    Raises:
        OSError: the write, fsync or rename failed (the target is then unchanged and the
            temporary file removed).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """fsync a folder, so the renames and creations in it are on disk (POSIX)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
