"""Find stop strings in streamed text, holding back only what might begin one.

A stop string can arrive split across tokens ("EN" then "D"). Text that could be the start
of a stop string is held back until the next piece shows whether it completes one; text that
cannot is released at once, so streaming is delayed by at most `max(len(stop)) - 1`
characters, and only while a possible match is pending.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Cuts one sequence's text at the earliest stop string.

    Args:
        stops: strings that end generation; empty strings are ignored. The matched stop
            string is never returned.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has been found."""
        return self._stopped

    def push(self, text: str) -> tuple[str, bool]:
        """Add new text; return `(text safe to emit now, stop string found)`.

        When a stop string is found, the returned text ends right before it (the earliest
        occurrence of any stop string wins) and everything after it is dropped. After a stop,
        further pushes return `("", True)`.
        """
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self._stopped = True
            return buf[:cut], True
        # No stop string in buf, so any stop string that starts in buf must run past its end:
        # the longest suffix of buf that is a proper prefix of a stop string is all that
        # could still become one. Everything before it is safe.
        hold = self._longest_pending_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Return the held-back text at a finish that was not a stop string (e.g. EOS, length)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _longest_pending_suffix(self, buf: str) -> int:
        best = 0
        for stop in self._stops:
            # Only lengths longer than the best so far can matter.
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
