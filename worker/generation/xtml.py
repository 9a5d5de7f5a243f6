"""Kimi K3's XTML tool calls (vLLM's ``kimi_k3`` parser): channels written with three
special tokens, ``<|open|>NAME<|sep|>`` ... ``<|close|>NAME<|sep|>``.

The calls are in a ``tools`` channel, each ``<|open|>call tool="NAME" index="1"<|sep|>``,
its arguments ``<|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>``,
then ``<|close|>call<|sep|>``; an attribute's value escapes ``&`` and ``"`` (``&amp;``,
``&quot;``). A ``string`` value (or one without a type) is as written, another JSON (else
as written): the model types its values, the schema does not. The answer is in the
``response`` channel before it, whose markers the ``kimi_k3`` reasoning parser leaves out
(``reasoning.WRAPS``), or, without it, :func:`answer` as vLLM's tool parser does.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from .json_compact import Pairs
from .reasoning import held

TOOLS: Final = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
"""The calls' channel's markers."""
RESPONSE: Final = ("<|open|>response<|sep|>", "<|close|>response<|sep|>")
"""The answer's channel's markers."""
MESSAGE_END: Final = "<|close|>message<|sep|>"
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


def answer(text: str) -> str:
    """The answer of a text (so far) read without the ``kimi_k3`` reasoning parser, as
    vLLM's tool parser reads it: the content, then the tools channel (to its close), if
    any. A text that opens a channel first is read by its channels: the content is the
    response channel's (to its close), or, with none, the text before the tools channel
    less its closing markers (none shown before that channel opens, or the text ends); a
    bare text's content runs to its first marker (the prompt opened the response)."""
    t = text.find(TOOLS[0])
    before = text if t < 0 else text[:t]
    tools = ""
    if t >= 0:
        close = text.find(TOOLS[1], t)
        tools = text[t : len(text) if close < 0 else close + len(TOOLS[1])]
    if not text.lstrip().startswith(PIECES[0][: len(text.lstrip())]):  # bare
        stops: tuple[str, ...] = (RESPONSE[1], MESSAGE_END, PIECES[0])
    elif (o := before.find(RESPONSE[0])) >= 0:
        before, stops = before[o + len(RESPONSE[0]) :], (RESPONSE[1], MESSAGE_END)
    elif t >= 0:
        return before.replace(RESPONSE[1], "").replace(MESSAGE_END, "") + tools
    else:
        return ""  # the response channel may still open
    cut = min((at for m in stops if (at := before.find(m)) >= 0), default=-1)
    if cut >= 0:
        return before[:cut] + tools
    if t >= 0:
        return before + tools
    return before[: len(before) - max(held(before, m) for m in (*stops, TOOLS[0]))]


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
