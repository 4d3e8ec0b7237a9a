"""Stored Responses: the records behind `store: true` and `previous_response_id`.

A record (`StoredResponse`) holds the public response object, the conversation as chat
messages, its exact text and token ids. `ResponseStore` keeps them in memory and, with a
folder, one JSON file each (written atomically, `flare.atomic_file`); with a remote tier
it also publishes them in Redis (`flare.state.remote_responses`), so any replica finds a
continuation's parent. The routes are in `flare.server.responses`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flare.atomic_file import write_text_atomic
from flare.server.responses_protocol import RESPONSE_ID
from flare.state.remote_responses import DELETED

log = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 512  # beside the named sessions, within the registry's MAX_SESSIONS
RESPONSE_ID_PATTERN = re.compile(RESPONSE_ID)  # checked before an id names a file


@dataclass
class StoredResponse:
    """One stored response.

    Attributes:
        id: the response id (also its session's name).
        body: the public response object (what GET returns).
        instructions: the instructions it ran with (a leading system message), or None.
        messages: the conversation after the instructions, as chat messages, this
            response's own output last.
        text: the conversation's exact text: the prompt then every generated token.
        tokens: its token ids (prompt + generated); `tokens[:-1]` is the computed state.
    """

    id: str
    body: dict[str, Any]
    instructions: str | None
    messages: list[dict[str, Any]]
    text: str
    tokens: list[int]


class ResponseStore:
    """Stored responses by id, oldest first; persisted one JSON file each in `folder`.

    Thread-safe. Ids are checked against `RESPONSE_ID` before they name a file.

    Args:
        folder: where the records live (None: in memory only).
        limit: most records kept; `put` beyond it forgets the oldest.
        shared: a `flare.state.remote_responses.RemoteResponses` (the replicas' Redis), or
            None. Records are published there too, and a record this replica lacks is
            looked up there (so a continuation may land on any replica).
    """

    def __init__(self, folder: Path | None, limit: int = MAX_STORED_RESPONSES,
                 shared: Any = None) -> None:
        self.folder = folder
        self.limit = limit
        self.shared = shared
        self._lock = threading.Lock()
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        if folder is not None:
            self._load()

    def _load(self) -> None:
        loaded = []
        for path in self.folder.glob("resp_*.json"):
            if not RESPONSE_ID_PATTERN.fullmatch(path.stem):
                continue
            try:
                rec = StoredResponse(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring unreadable stored response %s: %s", path, exc)
                continue
            loaded.append((rec.body.get("created_at", 0), path.stat().st_mtime, rec))
        for _, _, rec in sorted(loaded, key=lambda t: t[:2]):
            self._records[rec.id] = rec

    def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None when there is none (a bad id included). With `shared`, Redis
        is asked first (one round trip: call this off the event loop): a record deleted on
        another replica is dropped here too, one this replica lacks is taken from there."""
        with self._lock:
            rec = self._records.get(response_id)
        if self.shared is None or not RESPONSE_ID_PATTERN.fullmatch(response_id):
            return rec
        status, found = self.shared.get(response_id)
        if status == DELETED:
            if rec is not None:
                with self._lock:
                    self._records.pop(response_id, None)
                self._unlink(response_id)
            return None
        if rec is not None or found is None:  # Redis down or the record expired: ours
            return rec
        try:
            return StoredResponse(**found)
        except TypeError:  # another Flare version's record: continue from scratch
            return None

    def put(self, rec: StoredResponse) -> list[str]:
        """Keep `rec` (written before it is listed); returns the ids forgotten to stay
        within the limit."""
        self._write(rec)
        if self.shared is not None:
            self.shared.put(rec.id, asdict(rec))
        with self._lock:
            self._records[rec.id] = rec
            old = []
            while len(self._records) > self.limit:
                old.append(self._records.popitem(last=False)[0])
        for rid in old:
            self._unlink(rid)
        return old

    def delete(self, response_id: str) -> bool:
        """Forget a record (here and in `shared`); False when there was none."""
        with self._lock:
            found = self._records.pop(response_id, None) is not None
        if found:
            self._unlink(response_id)
        if self.shared is not None and RESPONSE_ID_PATTERN.fullmatch(response_id):
            found = self.shared.delete(response_id) or found
        return found

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def _path(self, response_id: str) -> Path | None:
        if self.folder is None or not RESPONSE_ID_PATTERN.fullmatch(response_id):
            return None
        return self.folder / f"{response_id}.json"

    def _write(self, rec: StoredResponse) -> None:
        path = self._path(rec.id)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(asdict(rec), ensure_ascii=False))

    def _unlink(self, response_id: str) -> None:
        path = self._path(response_id)
        if path is not None:
            path.unlink(missing_ok=True)
