"""Gemma 4's tool-call arguments, read as vLLM's ``gemma4`` parser reads them: ``KEY:VALUE``
pairs separated by commas, each value a string between ``<|"|>`` delimiters, an object
``{...}`` of such pairs, an array ``[...]``, or bare: ``true``, ``false``, ``null`` (or
``none``, ``nil``, any case), a number (a float where it has a ``.``, else an integer),
else the bare text, trimmed. A key written twice keeps its last value, in its first place.

:func:`read` reads a call's arguments whole (what the text's end cuts is read as far as it
goes, as vLLM's); :func:`settled` reads only the pairs a text so far has ended, so those
streamed are a start of what the whole call reads.
"""

from __future__ import annotations

import math
from typing import Any, Final

from .json_compact import Pairs

DELIM: Final = '<|"|>'
"""A string value's delimiter (a token of Gemma 4's tokenizer)."""
_SKIP: Final = " ,\n\t"
_SPACE: Final = " \n\t"


def read(text: str) -> Pairs:
    """The arguments ``text`` (between a call's braces) holds, read whole."""
    return _pairs(text, "whole")


def settled(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The arguments written whole in ``text`` from ``at`` (a call's text so far, after its
    ``{``): the pairs before the first one not yet ended (``known`` is unused: Gemma 4's
    values carry their own types)."""
    return _pairs(text[at:], "settled")


def _pairs(s: str, mode: str) -> Pairs:
    """``KEY:VALUE`` pairs; ``mode``: ``whole`` (vLLM's text read as ended), ``partial``
    (vLLM's for an object the end cut: a bare value at the end left out) or ``settled``
    (only the values a delimiter has ended)."""
    out: dict[str, Any] = {}
    i, n = 0, len(s)
    while i < n:
        while i < n and s[i] in _SKIP:
            i += 1
        colon = s.find(":", i)
        if i >= n or colon < 0:
            break
        key = s[i:colon].strip()
        if key.startswith(DELIM) and key.endswith(DELIM):  # (vLLM's: a quoted key)
            key = key[len(DELIM) : -len(DELIM)]
        i = colon + 1
        while i < n and s[i] in _SPACE:
            i += 1
        if i >= n:
            if mode == "whole":
                out[key] = ""
            break
        got = _value(s, i, mode, ",}]")
        if got is None:
            break
        out[key], i = got
    return Pairs(list(out.items()))


def _items(s: str, mode: str) -> list[Any]:
    """An array's items (its text between the brackets), as :func:`_pairs` reads pairs."""
    out: list[Any] = []
    i, n = 0, len(s)
    while i < n:
        while i < n and s[i] in _SKIP:
            i += 1
        if i >= n:
            break
        got = _value(s, i, mode, ",]")
        if got is None:
            break
        value, i = got
        out.append(value)
    return out


def _value(s: str, i: int, mode: str, stops: str) -> tuple[Any, int] | None:
    """The value at ``i`` and where it ends (a bare one at the first of ``stops``); None:
    none to take (the end cut it where ``mode`` leaves that out, or nothing is there)."""
    n = len(s)
    if s.startswith(DELIM, i):
        start = i + len(DELIM)
        end = s.find(DELIM, start)
        if end >= 0:
            return s[start:end], end + len(DELIM)
        return None if mode == "settled" else (s[start:], n)  # (what follows: nothing)
    if s[i] in "{[":
        opening, closing = ("{", "}") if s[i] == "{" else ("[", "]")
        read = _pairs if opening == "{" else _items
        closed = _closed(s, i + 1, opening, closing)
        if closed is not None:
            return read(s[i + 1 : closed - 1], "whole"), closed
        return None if mode == "settled" else (read(s[i + 1 :], "partial"), n)
    start = i
    while i < n and s[i] not in stops:
        i += 1
    if i == start or (i >= n and mode != "whole"):
        return None
    if mode == "partial" and s[start:i].strip().endswith("."):
        return None  # (vLLM's: more digits may come)
    return _bare(s[start:i]), i


def _closed(s: str, i: int, opening: str, closing: str) -> int | None:
    """Where the object or array whose ``opening`` bracket ends at ``i`` closes (after its
    ``closing`` one; strings skipped, the other kind of bracket not counted); None: open."""
    depth, n = 1, len(s)
    while i < n:
        if s.startswith(DELIM, i):
            end = s.find(DELIM, i + len(DELIM))
            if end < 0:
                return None
            i = end + len(DELIM)
            continue
        depth += (s[i] == opening) - (s[i] == closing)
        i += 1
        if depth == 0:
            return i
    return None


def _bare(raw: str) -> Any:
    """A bare value: a boolean, null, a number, else its text (trimmed); a number that is
    not finite stays text (vLLM's would write JSON's ``Infinity``, which is not JSON)."""
    value = raw.strip()
    if value in ("true", "false"):
        return value == "true"
    if value.lower() in ("null", "none", "nil"):
        return None
    try:
        number = float(value) if "." in value else int(value)
    except ValueError:
        return value
    return number if math.isfinite(number) else value
