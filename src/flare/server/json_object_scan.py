"""Where one top-level JSON object ends in text that arrives in pieces: the scanner the
tool-call parsers (`flare.server.tool_calls`) use to find a call's end while it streams.
"""

from __future__ import annotations

import re


class Malformed(Exception):
    """The text cannot be (the rest of) one JSON object; the message is the character at
    fault."""


_OUTSIDE_STRING = re.compile(r'[\s{}\[\]:,0-9eE+\-.truefalsn]')
_STRING_STOP = re.compile(r'["\\]')


class ObjectScanner:
    """Finds where one top-level JSON object ends, reading text incrementally.

    Braces inside strings do not count, escapes are honoured, and a character that can never
    appear outside a JSON string (such as `<` of markup) fails the scan at once. It checks
    shape, not full JSON grammar: the complete object is then parsed with `json.loads`.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False

    def feed(self, text: str, start: int) -> int | None:
        """Scan `text[start:]`; the index just past the closing brace, or None for more.

        Raises:
            Malformed: the text cannot be (the rest of) one JSON object.
        """
        i, n = start, len(text)
        while i < n:
            if self.in_string:
                if self.escape:
                    self.escape = False
                    i += 1
                    continue
                m = _STRING_STOP.search(text, i)
                if m is None:
                    return None
                i = m.end()
                if m.group() == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                continue
            c = text[i]
            i += 1
            if c.isspace():
                continue
            if self.depth == 0 and c != "{":
                raise Malformed(c)
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i
            elif not _OUTSIDE_STRING.match(c):
                raise Malformed(c)
        return None
