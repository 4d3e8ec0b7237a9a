"""Named sessions: a client-chosen name for the latest state of one conversation.

A request that names a session (`"session": "NAME"`, docs/api-extensions.md) records, when
it finishes, the token ids whose state it computed (prompt plus completion, all but the
last sampled token). The name then lets a client:

- save that state to the disk tier (`POST /v1/sessions/NAME/save`), so it survives a
  restart; the next request that resends the conversation restores it through the normal
  lookup (the state is found by its tokens, never by the name). With write-through (the
  default with a state folder) every finished turn is saved so, without a call: the name
  is marked saved once the turn's chain is written, so it survives even a SIGKILL;
- keep it on the device: its pages (and checkpoint) are pinned (`SessionPins`), within a
  budget of pages; a request that would pin past it is refused;
- fork it (`POST /v1/sessions/NAME/fork`): the new name starts from the same state, which
  shares its pages by reference (a branch copies nothing until it writes);
- read or forget it (`GET` / `DELETE /v1/sessions/NAME`).

Names are validated (`SESSION_NAME`: letters, digits, `.`, `_`, `-`, at most 128) and are
never used as paths: saved names are stored in one JSON file per package in the state
folder, written atomically (temporary file, fsync, rename). With the Redis remote tier
(`flare.state.remote_sessions.RemoteSessions`) saved names are published there instead, so
every replica of the package sees them; the latest save of a name, on any replica, wins.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flare.atomic_file import write_text_atomic

if TYPE_CHECKING:
    from flare.state.checkpoints import Checkpoint, CheckpointIndex
    from flare.state.pools import PagePool
    from flare.state.remote_sessions import RemoteSessions

SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FORMAT_VERSION = 1
MAX_SESSIONS = 1024  # names held at once: each persisted one costs bytes in every rewrite

log = logging.getLogger(__name__)


class SessionError(ValueError):
    """A bad session name, or a session that does not exist (`missing` is True then);
    `code` says which refusal it is where it is neither (e.g. "too_many_sessions")."""

    def __init__(self, message: str, missing: bool = False, code: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing
        self.code = code


def check_name(name: str) -> str:
    """Return `name` if it is a valid session name.

    Raises:
        SessionError: naming the bad value and the rule.
    """
    if not isinstance(name, str) or not SESSION_NAME.fullmatch(name):
        raise SessionError(f"session name {name!r} is not valid: use 1-128 letters, digits, "
                           f"'.', '_' or '-', starting with a letter or digit")
    return name


@dataclass
class Session:
    """The latest state of a named conversation.

    Attributes:
        tokens: token ids whose state was computed (positions [0, len(tokens))).
        saved_tokens: positions of it written to the disk tier by the last save (0: never).
    """

    tokens: list[int]
    saved_tokens: int = 0


class SessionRegistry:
    """Session name -> `Session`, shared by the engine thread (which records finished
    requests) and the HTTP handlers (thread-safe). Saved sessions persist in `folder`.

    Args:
        folder: the state folder (None: nothing persists in a file).
        namespace: the package id; the file of another package is never read.
        remote: saved names shared through Redis (`RemoteSessions`), or None.
    """

    def __init__(self, folder: Path | None, namespace: str,
                 remote: "RemoteSessions | None" = None) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._updated: dict[str, float] = {}  # name -> wall time of its latest change here
        self.remote = remote
        self.namespace = namespace
        self.path = None
        if folder is not None:
            digest = namespace[:16] or "default"
            self.path = Path(folder) / f"sessions-{digest}.json"
            self._load()

    def has_room(self, name: str) -> bool:
        """Whether `name` exists or a new session may still be named (`MAX_SESSIONS`)."""
        with self._lock:
            return name in self._sessions or len(self._sessions) < MAX_SESSIONS

    def record(self, name: str, tokens: list[int]) -> None:
        """The session's latest state is now `tokens` (engine thread, at a finish)."""
        with self._lock:
            old = self._sessions.get(name)
            saved = old.saved_tokens if old and old.tokens[:old.saved_tokens] == tokens[
                :old.saved_tokens] else 0
            self._sessions[name] = Session(list(tokens), saved)
            self._updated[name] = time.time()

    def get(self, name: str) -> Session:
        """Raises SessionError (missing) when there is no such session."""
        check_name(name)
        shared = self.remote.get(name) if self.remote is not None else None
        with self._lock:
            s = self._sessions.get(name)
            if shared is not None and (s is None or shared[2] > self._updated.get(name, 0)):
                # saved by another replica (or here) after this replica last changed it
                s = self._sessions[name] = Session(list(shared[0]), shared[1])
                self._updated[name] = shared[2]
            if s is None:
                raise SessionError(f"session {name!r} does not exist", missing=True)
            return Session(list(s.tokens), s.saved_tokens)

    def fork(self, name: str, new: str) -> Session:
        """Start session `new` from `name`'s state. Raises SessionError: a bad or missing
        name, or `new` already exists."""
        check_name(new)
        src = self.get(name)
        with self._lock:
            if new in self._sessions:
                raise SessionError(f"session {new!r} already exists")
            if len(self._sessions) >= MAX_SESSIONS:
                raise SessionError(f"{MAX_SESSIONS} sessions exist already: delete one first",
                                   code="too_many_sessions")
            self._sessions[new] = Session(src.tokens, src.saved_tokens)
            self._updated[new] = time.time()
        if self.remote is not None and src.saved_tokens:
            self.remote.put(new, src.tokens, src.saved_tokens)
        self._persist()
        return src

    def delete(self, name: str) -> None:
        """Forget a session (its state stays cached until evicted). Raises SessionError."""
        self.get(name)
        with self._lock:
            if self._sessions.pop(name, None) is None:  # a concurrent delete came first
                raise SessionError(f"session {name!r} does not exist", missing=True)
            self._updated.pop(name, None)
        if self.remote is not None:
            self.remote.delete(name)
        self._persist()

    def mark_saved(self, name: str, tokens: list[int], saved_tokens: int) -> bool:
        """Record that `saved_tokens` positions of `tokens` are on disk, and persist.
        A session deleted meanwhile stays deleted, and one that moved on keeps its newer
        tokens (saved only if they extend what was written). Returns whether it is marked."""
        with self._lock:
            cur = self._sessions.get(name)
            if cur is None or cur.tokens[:saved_tokens] != list(tokens[:saved_tokens]):
                return False
            cur.saved_tokens = saved_tokens
            self._updated[name] = time.time()
            shared = (list(cur.tokens), saved_tokens)
        if self.remote is not None:
            self.remote.put(name, *shared)
        self._persist()
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def snapshot(self) -> dict[str, Session]:
        """A copy of every session, by name (a shutdown save writes each one's state)."""
        with self._lock:
            return {n: Session(list(s.tokens), s.saved_tokens)
                    for n, s in self._sessions.items()}

    # ---- persistence --------------------------------------------------------------------

    def _load(self) -> None:
        """Read the saved sessions; a file that is missing, damaged or of another shape
        or package is ignored whole (logged), never half-read."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable sessions file %s: %s", self.path, exc)
            return
        try:
            if data["format"] != FORMAT_VERSION or data["namespace"] != self.namespace:
                return
            loaded = {name: Session([int(t) for t in s["tokens"]], int(s["saved_tokens"]))
                      for name, s in data["sessions"].items() if SESSION_NAME.fullmatch(name)}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("ignoring malformed sessions file %s: %r", self.path, exc)
            return
        self._sessions.update(dict(list(loaded.items())[:MAX_SESSIONS]))

    def _persist(self) -> None:
        """Write the saved sessions (those with saved_tokens > 0) atomically."""
        if self.path is None:
            return
        with self._lock:
            body = {"format": FORMAT_VERSION, "namespace": self.namespace,
                    "sessions": {n: {"tokens": s.tokens, "saved_tokens": s.saved_tokens}
                                 for n, s in self._sessions.items() if s.saved_tokens}}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # durable: the rename survives a power loss too
            write_text_atomic(self.path, json.dumps(body), durable=True)


class SessionPins:
    """Device pages (and, for hybrid recipes, the checkpoint) of each named session's
    latest state, held so eviction cannot take them, within a budget of pages.

    A pin is one more holder of each page (a reference in the `PagePool`) and a pin on the
    checkpoint; the prefix index evicts only pages nobody else holds, so a pinned state
    stays on the device until the session is deleted or moves on. Engine thread only,
    except `pinned_pages`, a plain int other threads may read.

    Args:
        pool: the KV page pool.
        budget_pages: most pages pinned by all sessions together.
        checkpoints: hybrid recipes: the checkpoint index (None for KV-only).
    """

    def __init__(self, pool: "PagePool", budget_pages: int,
                 checkpoints: "CheckpointIndex | None" = None) -> None:
        self.pool, self.budget_pages, self.checkpoints = pool, budget_pages, checkpoints
        self._pins: dict[str, tuple[list[int], "Checkpoint | None"]] = {}
        self.pinned_pages = 0

    def pages_of(self, name: str) -> int:
        pin = self._pins.get(name)
        return len(pin[0]) if pin else 0

    def fits(self, name: str, num_pages: int) -> bool:
        """Whether session `name` may pin `num_pages` pages (its current pin replaced)."""
        return self.pinned_pages - self.pages_of(name) + num_pages <= self.budget_pages

    def pin(self, name: str, pages: list[int], ckpt: "Checkpoint | None" = None) -> bool:
        """Pin `pages` (held by the caller now) and `ckpt` as `name`'s state, replacing
        its previous pin. Returns False, pinning nothing new and releasing the old pin,
        when that would exceed the budget (the state then ages out as any other)."""
        self.release(name)
        if not self.fits(name, len(pages)):
            return False
        self.pool.incref(pages)
        if ckpt is not None:
            self.checkpoints.pin(ckpt)
        self._pins[name] = (list(pages), ckpt)
        self.pinned_pages += len(pages)
        return True

    def fork(self, name: str, new: str) -> bool:
        """Pin `name`'s state for `new` too (no copy). False: nothing pinned, or over budget."""
        pin = self._pins.get(name)
        return pin is not None and self.pin(new, pin[0], pin[1])

    def release(self, name: str) -> None:
        """Let go of `name`'s pin (nothing when it has none)."""
        pin = self._pins.pop(name, None)
        if pin is None:
            return
        pages, ckpt = pin
        self.pinned_pages -= len(pages)
        self.pool.release(pages)
        if ckpt is not None:
            self.checkpoints.unpin(ckpt)

    def held_pages(self) -> list[int]:
        """Every pinned page, once per pin (for the engine's accounting check)."""
        return [p for pages, _ in self._pins.values() for p in pages]

    def held_checkpoints(self) -> list["Checkpoint"]:
        return [c for _, c in self._pins.values() if c is not None]
