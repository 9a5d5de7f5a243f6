"""A tool call's arguments as compact JSON text, written whole or as the model writes it.

A call's ``arguments`` are the JSON object the model wrote, rewritten compact
(:func:`compact`): no whitespace outside strings, each string and number as
:func:`json.dumps` writes it (``ensure_ascii=False``), each object's members in the order
written, a key written twice kept twice (``json.loads`` of the text keeps the last, as of
the model's). :class:`Compactor` writes the same text as the model's text comes, so a
stream sends a call's arguments piece by piece (OpenAI's ``delta.tool_calls``) and the
pieces add up to the result's: it takes in raw characters and gives out what they settle,
holding a number (``1`` may become ``1.5``) or an escape until it ends.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

MAX_DEPTH: Final = 256
"""Deeper nesting stops a :class:`Compactor` (and no call reads that deep)."""


class Pairs(dict[str, Any]):
    """A decoded JSON object that keeps its members as written (``pairs``), a key written
    twice included; as a dict, the last of each key counts (``json.loads``'s)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


DECODER: Final = json.JSONDecoder(object_pairs_hook=Pairs)
"""Decodes JSON keeping each object's members as written."""


def compact(value: Any) -> str:
    """``value`` as compact JSON text (objects decoded by :data:`DECODER` as written)."""
    if isinstance(value, dict):
        items = value.pairs if isinstance(value, Pairs) else value.items()
        return "{" + ",".join(f"{_text(k)}:{compact(v)}" for k, v in items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(compact(v) for v in value) + "]"
    return _text(value)


def _text(scalar: Any) -> str:
    """A scalar as json.dumps writes it, but a lone surrogate escaped (``\\ud800``, as
    ``ensure_ascii`` writes it), so the text is valid UTF-8."""
    out = json.dumps(scalar, ensure_ascii=False)
    return _LONE.sub(_escaped, out) if isinstance(scalar, str) else out


_LONE: Final = re.compile("[\ud800-\udfff]")


def _escaped(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


_SPACE: Final = frozenset(" \t\n\r")
_SCALAR: Final = frozenset("0123456789+-.eEaflnrstuINyif")
"""The characters of a number or of ``true``, ``false``, ``null``, ``NaN``, ``Infinity``."""
_ESCAPES: Final = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                   "t": "\t"}  # fmt: skip
_HEX: Final = frozenset("0123456789abcdefABCDEF")
_PLAIN: Final = re.compile('[^"\\\\\x00-\x1f\ud800-\udfff]+')

# what a Compactor expects next, outside strings and scalars
_VALUE, _ITEM_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _DONE = range(7)


class Compactor:
    """One JSON object's :func:`compact` text, as its raw text comes (see the module's
    docstring). Feed it the text from the object's ``{`` on, each time the one before and
    more; it stops for good (``failed``) at what is not JSON."""

    __slots__ = ("_escape", "_high", "_in_string", "_key", "_scalar", "_stack",
                 "_state", "end", "failed", "out", "read")  # fmt: skip

    def __init__(self) -> None:
        self.out: list[str] = []
        """The compact text settled so far, in pieces."""
        self.read = 0
        """How many characters of the raw text it has taken in."""
        self.end: int | None = None
        """Where the object's raw text ends (after its ``}``), once it has."""
        self.failed = False
        self._stack: list[str] = []
        """The open containers' closing brackets."""
        self._state = _VALUE
        self._in_string = False
        self._key = False
        """The open string is a key."""
        self._escape: str | None = None
        """An escape being read (from its backslash)."""
        self._high: str | None = None
        """A ``\\uD800``-``\\uDBFF`` escape read, waiting for its low half."""
        self._scalar: list[str] = []

    @property
    def text(self) -> str:
        """The compact text settled so far (a start of the whole object's)."""
        if len(self.out) > 1:
            self.out[:] = ["".join(self.out)]
        return self.out[0] if self.out else ""

    def feed(self, raw: str) -> None:
        """Take in ``raw`` (the object's text so far) past what was read."""
        if self.failed or self.end is not None:
            return
        i, n = self.read, len(raw)
        while i < n:
            if self._in_string and self._escape is None and self._high is None:
                run = _PLAIN.match(raw, i)  # characters json.dumps writes as they are
                if run is not None:
                    self._put(run.group())
                    i = run.end()
                    continue
            if not self._take(raw[i]):
                self.failed = True
                return
            i += 1
            if self._state == _DONE:
                self.end = i
                break
        self.read = i

    def _put(self, piece: str) -> None:
        self.out.append(piece)

    def _take(self, c: str) -> bool:
        if self._in_string:
            return self._string(c)
        if self._scalar:
            if c in _SCALAR:
                self._scalar.append(c)
                return len(self._scalar) <= 400
            if not self._end_scalar():
                return False
        if c in _SPACE:
            return True
        state = self._state
        if state in (_VALUE, _ITEM_OR_CLOSE):
            if not self._stack and c != "{":
                return False  # arguments are an object
            if c in "{[":
                if len(self._stack) >= MAX_DEPTH:
                    return False
                self._stack.append("}" if c == "{" else "]")
                self._state = _KEY_OR_CLOSE if c == "{" else _ITEM_OR_CLOSE
                self._put(c)
                return True
            if c == "]" and state == _ITEM_OR_CLOSE:
                return self._close(c)  # an empty array
            if c == '"':
                self._open_string(key=False)
                return True
            if c in _SCALAR:
                self._scalar.append(c)
                return True
            return False
        if state in (_KEY_OR_CLOSE, _KEY):
            if c == '"':
                self._open_string(key=True)
                return True
            return state == _KEY_OR_CLOSE and c == "}" and self._close(c)
        if state == _COLON:
            if c != ":":
                return False
            self._put(c)
            self._state = _VALUE
            return True
        if state == _AFTER:
            if c == ",":
                self._put(c)
                self._state = _KEY if self._stack[-1] == "}" else _VALUE
                return True
            return c == self._stack[-1] and self._close(c)
        return False

    def _close(self, c: str) -> bool:
        self._stack.pop()
        self._put(c)
        self._state = _AFTER if self._stack else _DONE
        return True

    def _open_string(self, key: bool) -> None:
        self._in_string = True
        self._key = key
        self._put('"')

    def _string(self, c: str) -> bool:
        if self._escape is not None:
            self._escape += c
            esc = self._escape
            if esc[1] == "u":
                if len(esc) == 2:
                    return True
                if c not in _HEX:
                    return False
                if len(esc) < 6:
                    return True
                self._escape = None
                return self._char(chr(int(esc[2:], 16)))
            self._escape = None
            got = _ESCAPES.get(c)
            return got is not None and self._char(got)
        if c == "\\":
            self._escape = c
            return True
        if c == '"':
            if self._high is not None:  # a lone high surrogate, as json.dumps writes it
                self._put(_text(self._high)[1:-1])
                self._high = None
            self._in_string = False
            self._put(c)
            self._state = _COLON if self._key else _AFTER
            return True
        if c < " ":
            return False  # a control character must be escaped (json's strict reading)
        return self._char(c)

    def _char(self, c: str) -> bool:
        """A character of a string, decoded (an escape's): written as json.dumps would."""
        if self._high is not None:
            high, self._high = self._high, None
            if "\udc00" <= c <= "\udfff":
                c = chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(c) - 0xDC00))
            else:
                self._put(_text(high)[1:-1])
        if "\ud800" <= c <= "\udbff":
            self._high = c  # a pair's first half, perhaps
            return True
        self._put(_text(c)[1:-1])
        return True

    def _end_scalar(self) -> bool:
        token = "".join(self._scalar)
        self._scalar.clear()
        try:
            value = json.loads(token)
        except (ValueError, RecursionError):
            return False
        if isinstance(value, dict | list | str):
            return False
        self._put(_text(value))
        self._state = _AFTER
        return True
