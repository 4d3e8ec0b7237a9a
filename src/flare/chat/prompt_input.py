"""What `flare chat` reads at its prompt: the keys (prompt_toolkit) and Ctrl+C.

Enter sends; Alt+Enter (Esc then Enter) starts a new line, and so does Enter inside a
message that begins with three quotes (it ends at a line ending with three quotes); a
paste keeps its newlines.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from prompt_toolkit.key_binding import KeyBindings

QUOTES = '"""'


def key_bindings() -> KeyBindings:
    """Enter sends, unless a triple-quoted message is still open; Esc Enter is a newline."""
    kb = KeyBindings()

    @kb.add("enter")
    def _enter(event: Any) -> None:
        buf = event.current_buffer
        text = buf.document.text
        if text.lstrip().startswith(QUOTES) and not (
                len(text.strip()) > 3 and text.rstrip().endswith(QUOTES)):
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    return kb


def unquote(text: str) -> str:
    """The message of a prompt's text: without its triple quotes and bordering newlines."""
    t = text.strip()
    if t.startswith(QUOTES):
        t = t[3:]
        if t.rstrip().endswith(QUOTES):
            t = t.rstrip()[:-3]
    return t.strip("\n")


@contextlib.contextmanager
def ctrl_c_interrupts() -> Iterator[None]:
    """Ctrl+C (SIGINT) raises KeyboardInterrupt inside the block, whatever disposition the
    process started with: a shell starts a command run with `&` (job control off) with
    SIGINT ignored, and Python then keeps ignoring it, so neither a streaming answer nor
    the prompt's edge would ever see Ctrl+C. (prompt_toolkit reads Ctrl+C as a key while it
    holds the terminal, and puts this handler back after.) The previous disposition comes
    back after the block. Only the main thread may set handlers; elsewhere (tests driving
    the REPL from a thread) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
