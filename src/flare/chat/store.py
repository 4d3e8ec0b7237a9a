"""The conversations of `flare chat`, kept as text on this machine.

A Flare server keeps a session's *state* (its tokens' KV pages, on the device and in the
disk tier) but not its messages: chat requests are stateless, the client resends the whole
conversation and the server finds the state by its tokens (docs/api-extensions.md,
"Sessions"). So the terminal chat keeps each conversation's messages in one JSON file,
`FOLDER/MODEL/NAME.json` (written atomically: temporary file, fsync, rename), named like
the server session it uses. A new `flare chat` reads it back and resends it; the server
restores the state from its disk tier (after a restart too), so the first answer reuses
the whole conversation.

Names follow the server's session names (`flare.state.sessions.SESSION_NAME`), so they
never become odd paths.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flare.atomic_file import write_text_atomic
from flare.state.sessions import SESSION_NAME

FORMAT_VERSION = 1
LAST = ".last"  # the name of the conversation used last, per model folder


class StoreError(ValueError):
    """A bad conversation name, or one that does not exist."""


def check_name(name: str) -> str:
    """`name` if it is a valid session name. Raises StoreError naming the rule."""
    if not SESSION_NAME.fullmatch(name or ""):
        raise StoreError(f"{name!r} is not a valid session name: use 1-128 letters, digits, "
                         f"'.', '_' or '-', starting with a letter or digit")
    return name


@dataclass
class Conversation:
    """One conversation: a system prompt and the user/assistant turns since.

    Attributes:
        name: its session name on the server and its file name here.
        system: the system prompt (None: the model's chat template default).
        messages: {"role": "user" | "assistant", "content": str}, oldest first.
        forked_from: the conversation it was forked from, if any.
        updated: Unix time of the last write (seconds).
    """

    name: str
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    forked_from: str | None = None
    updated: float = 0.0

    def request_messages(self) -> list[dict[str, str]]:
        """What a chat request sends: the system message (if any), then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]


class ConversationStore:
    """The conversations of one model in `folder / MODEL` (created on first write).

    Args:
        folder: where `flare chat` keeps its files (default CACHE_DIR/chat).
        model: the served model id; conversations of another model are not listed.
    """

    def __init__(self, folder: Path, model: str) -> None:
        self.folder = Path(folder) / re.sub(r"[^A-Za-z0-9._-]", "_", model)

    def path(self, name: str) -> Path:
        return self.folder / f"{check_name(name)}.json"

    def exists(self, name: str) -> bool:
        return self.path(name).is_file()

    def names(self) -> list[str]:
        """Stored conversation names, most recently written first."""
        if not self.folder.is_dir():
            return []
        files = [p for p in self.folder.glob("*.json") if SESSION_NAME.fullmatch(p.stem)]
        return [p.stem for p in sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)]

    def load(self, name: str) -> Conversation:
        """Raises StoreError when it does not exist or cannot be read."""
        path = self.path(name)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StoreError(f"no conversation named {name!r} in {self.folder}") from None
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path} cannot be read: {exc}") from None
        if data.get("version") != FORMAT_VERSION:
            raise StoreError(f"{path} has format version {data.get('version')!r}, "
                             f"this flare reads {FORMAT_VERSION}")
        return Conversation(name=name, system=data.get("system"),
                            messages=list(data.get("messages") or []),
                            forked_from=data.get("forked_from"),
                            updated=float(data.get("updated") or 0.0))

    def save(self, conv: Conversation) -> None:
        """Write `conv` atomically and remember it as the last used."""
        path = self.path(conv.name)
        self.folder.mkdir(parents=True, exist_ok=True)
        conv.updated = time.time()
        data = {"version": FORMAT_VERSION, **asdict(conv)}
        data.pop("name")
        write_text_atomic(path, json.dumps(data, ensure_ascii=False, indent=1))
        self.set_last(conv.name)

    def set_last(self, name: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.folder / LAST, check_name(name))

    def last(self) -> str | None:
        """The conversation used last, if it still exists."""
        try:
            name = (self.folder / LAST).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        return name if SESSION_NAME.fullmatch(name) and self.exists(name) else None

    def new_name(self, stem: str = "chat") -> str:
        """The first of STEM-1, STEM-2, ... that is not stored yet."""
        i = 1
        while self.exists(f"{stem}-{i}"):
            i += 1
        return f"{stem}-{i}"
