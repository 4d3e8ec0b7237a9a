"""Where Flare keeps what it makes once and reuses: prepared packages of `serve --embedded`,
the disk tier's default folder, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$FLARE_CACHE_DIR, else $XDG_CACHE_HOME/flare, else ~/.cache/flare."""
    if env := os.environ.get("FLARE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flare"
