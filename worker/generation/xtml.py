"""Kimi K3's XTML tool calls (vLLM's ``kimi_k3`` parser): channels written with three
special tokens, ``<|open|>NAME<|sep|>`` ... ``<|close|>NAME<|sep|>``.

The calls are in a ``tools`` channel, each ``<|open|>call tool="NAME" index="1"<|sep|>``,
its arguments ``<|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>``,
then ``<|close|>call<|sep|>``; an attribute's value escapes ``&`` and ``"`` (``&amp;``,
``&quot;``). A ``string`` value (or one without a type) is as written, another JSON (else
as written): the model types its values, the schema does not. The answer is in the
``response`` channel before it, whose markers the ``kimi_k3`` reasoning parser leaves out
(``reasoning.WRAPS``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from .json_compact import Pairs

TOOLS: Final = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
"""The calls' channel's markers."""
CALL: Final = ("<|open|>call", "<|close|>call<|sep|>")
"""A call's block's markers (its attributes and ``<|sep|>`` follow the first)."""
PIECES: Final = ("<|open|>", "<|close|>", "<|sep|>")
"""The special tokens the markers are written with (kept in the text the parser reads)."""
MARKERS: Final = (*TOOLS, *CALL, *PIECES)

_ATTRS: Final = r"((?:(?!<\|sep\|>)[^\n])*)<\|sep\|>"
HEADER: Final = re.compile(r"\s+" + _ATTRS)
"""A call's attributes, after its opening marker (group 1)."""
_ARGUMENT: Final = re.compile(
    r"<\|open\|>argument\s+" + _ATTRS + r"(.*?)<\|close\|>argument<\|sep\|>", re.DOTALL
)
_ATTR: Final = re.compile(r'(\w+)="([^"]*)"')


def attrs(text: str) -> dict[str, str]:
    """A block's attributes, their escapes read (``&quot;`` before ``&amp;``, as vLLM's)."""
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def name(header: re.Match[str]) -> str:
    """The function a call's header (:data:`HEADER`'s match) names (``""``: none)."""
    return attrs(header.group(1)).get("tool", "")


def args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The arguments written whole in ``text`` from ``at``, each as its ``type`` says
    (``known``, the schema's types, is not read: the model types its values)."""
    out: list[tuple[str, Any]] = []
    for head, raw in _ARGUMENT.findall(text, at):
        got = attrs(head)
        value: Any = raw
        if got.get("type", "string") != "string":
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                value = raw
        out.append((got.get("key", ""), value))
    return Pairs(out)


def body(text: str, types: dict[str, dict[str, str]]) -> tuple[str, dict[str, Any], None] | None:
    """A call block's call (its text between the markers); None: it names no function."""
    m = HEADER.match(text)
    called = "" if m is None else name(m)
    if m is None or not called:
        return None
    return called, args(text, m.end(), {}), None
