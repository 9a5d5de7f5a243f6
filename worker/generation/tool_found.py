"""A tool call found in a generated text (where its text lies, its name and arguments), the
readers' signatures, and the small readers every format shares (whitespace, JSON, a
``{"name", "arguments"}`` object)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .json_compact import DECODER


@dataclass(frozen=True, slots=True)
class Found:
    """A call found in a text."""

    start: int
    end: int
    """Where its text lies (the first call's start and the last's end bound the calls'
    part of the text, markers and brackets included)."""
    name: str
    args: dict[str, Any]
    id: str | None = None
    """The model's own id for the call (``kimi_k2``; None: one is made)."""


Scan = Callable[[str, bool], list[Found]]
"""The calls complete in a text (``True``: the text is whole, so one cut at its end that
still parses counts too)."""
Resume = Callable[[str, bool, int], tuple[list[Found], int]]
"""A scan from an offset where an earlier, shorter text was settled; it returns the calls
from there and the new settled offset: the text before it reads the same however the
text goes on (0: never settled, read from the start each time)."""


def entry(value: Any, start: int, end: int) -> Found | None:
    """A call ``{"name": ..., "arguments" (or "parameters"): {...}}``; None if ``value``
    is not one (arguments may be JSON text of an object)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):
        args = parse_json(args)
    if not (isinstance(name, str) and name and isinstance(args, dict)):
        return None
    return Found(start, end, name, args)


def skip(text: str, i: int) -> int:
    """Where the text from ``i`` on, past its whitespace, goes on."""
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def decode(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value at ``i`` and where it ends (None: none complete there)."""
    try:
        return DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None


def parse_json(text: str) -> Any:
    """The JSON value that is the whole ``text`` (None: it is not one)."""
    try:
        return DECODER.decode(text)
    except (ValueError, RecursionError):
        return None
