"""Incremental scanners over streamed text: each takes the new text only, keeping a few characters of state, so a
stream's parsing costs time linear in the output however finely it is cut.

`MarkerFinder` finds a literal marker that may be split across pieces (`partial_marker`: how much of a piece's end
may begin one, to hold back); `BracketScanner` finds where a JSON or Python bracketed value (an object, array or
call list) closes, skipping brackets inside strings.
"""

from __future__ import annotations

import re


class MarkerFinder:
    """Where `marker` first occurs in text fed piece by piece."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.tail = ""  # the last len(marker) - 1 characters seen: a marker may straddle two pieces

    def find(self, text: str) -> int | None:
        """The index in `text` just past the first marker that ends inside it; None when none does. After a hit
        the finder starts afresh."""
        tail, window = self.tail, self.tail + text
        at = window.find(self.marker)
        if at < 0:
            keep = len(self.marker) - 1
            self.tail = window[len(window) - keep:] if keep else ""
            return None
        self.tail = ""
        return at + len(self.marker) - len(tail)


def partial_marker(marker: str, text: str) -> int:
    """How many characters at the end of `text` could begin `marker` (text to hold back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_JSON_SIGNIFICANT = re.compile(r'["\\{}\[\]]')
_PYTHON_SIGNIFICANT = re.compile(r'["\'\\{}\[\]()]')
_OPENERS, _CLOSERS = "{[(", "}])"


class BracketScanner:
    """Finds where a bracketed value closes. `python`: Python literals and calls (quotes ' and ", parentheses);
    else JSON. Strings are skipped with their backslash escapes. Work per character is constant."""

    def __init__(self, python: bool = False) -> None:
        self.significant = _PYTHON_SIGNIFICANT if python else _JSON_SIGNIFICANT
        self.depth = 0
        self.quote = ""  # the open string's quote character; "" outside strings
        self.escaped = False  # a backslash inside a string ended the last piece
        self.started = False

    def feed(self, text: str) -> int | None:
        """The index just past the character of `text` that closes the value; None while it is still open."""
        pos = 0
        if self.escaped and text:
            self.escaped, pos = False, 1
        while True:
            m = self.significant.search(text, pos)
            if m is None:
                return None
            ch, pos = m.group(), m.end()
            if self.quote:
                if ch == "\\":
                    if pos < len(text):
                        pos += 1  # the escaped character
                    else:
                        self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch
            elif ch in _OPENERS:
                self.depth += 1
                self.started = True
            elif ch in _CLOSERS:
                self.depth -= 1
                if self.depth <= 0 and self.started:
                    return pos
