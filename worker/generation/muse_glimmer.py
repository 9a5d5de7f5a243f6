"""MuseGlimmer's text read as vLLM's ``muse_glimmer`` reasoning and tool parsers read it.

MuseGlimmer writes messages, each a header naming who it is for, then its body up to
``<|eom|>`` or ``<|eot|>``::

    to=self<|message|>…reasoning…<|eom|>
    <|start|>assistant to=get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather"><atem:parameter name="city">Paris</atem:parameter>
    </atem:invoke></atem:function_calls><|eom|>
    <|start|>assistant to=user<|message|>…the answer…<|eot|>

(the prompt ends with ``<|start|>assistant``, so the first header may lack it). A
message's body also ends where the next header begins (a reasoning message the model left
open does not swallow the call after it), and never holds ``<|start|>``. The messages *to*
``self`` are the reasoning (their bodies one after the other, as vLLM's reasoning parser
streams them and its engine-based one reads them whole or streamed: its older one joined
them by a newline only in a whole result); those to ``user``, or with no recipient, the
content (joined); the others are tool channels, where the calls are
(vLLM's tool parser *selects* their bodies, so a call echoed in the reasoning or the
answer is none):

- a call is an ``<atem:invoke name="…">`` … ``</atem:invoke>`` with its
  ``<atem:parameter name="KEY">VALUE</atem:parameter>`` pairs, each value read as JSON,
  else kept as written; a name written twice over (``get_weather.get_weather``, as the
  template's recipients lead the model to) is the function's where the request has it;
- a text with no header at all is content, all of it (and its calls, where it writes
  ATEM's, are read from all of it).

Read so far, an open message's end that may be a marker, or a header (`` to=…``), being
written is held back, and so is a text with no header yet; calls come whole, once their
``</atem:invoke>`` is written (vLLM's stream them so too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from typing import Any, Final

from .reasoning import held

START, MESSAGE, EOM, EOT = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"
TOKENS: Final = (START, MESSAGE, EOM, EOT)
"""Its framing markers (special tokens, kept in the text it reads)."""
SELF, USER = "self", "user"

_HEADER: Final = re.compile(
    r"(?:<\|start\|>\s*assistant)?[^\S\n]*(?:to=(?P<to>[A-Za-z0-9_.\-]+))?<\|message\|>"
)
_END: Final = re.compile(r"<\|eom\|>|<\|eot\|>")
_OPEN_TO: Final = re.compile(r"[^\S\n]*(?:t|to|to=[A-Za-z0-9_.\-]*)?\Z")
"""A header's `` to=NAME`` perhaps being written at an open body's end (a header may
follow a body with no end marker, its spaces and recipient included)."""
_INVOKE: Final = re.compile(r"<atem:invoke\b.*?</atem:invoke>", re.DOTALL)
_NAME: Final = re.compile(r'<atem:invoke\b[^>]*?\bname="([^"]+)"')
_PARAM: Final = re.compile(
    r'<atem:parameter\b[^>]*?\bname="([^"]+)"[^>]*?>(.*?)</atem:parameter>', re.DOTALL
)
_ATEM: Final = ("<atem:function_calls>", "<atem:invoke")


def messages(text: str) -> Iterator[tuple[str | None, int, int, bool]]:
    """The messages of ``text``: each its recipient (None: none named), where its body
    begins and ends, and whether an end marker closed it."""
    pos = 0
    while (header := _HEADER.search(text, pos)) is not None:
        body = header.end()
        end = _END.search(text, body)
        after = _HEADER.search(text, body)
        stop, closed = (end.start(), True) if end is not None else (len(text), False)
        pos = end.end() if end is not None else len(text)
        if after is not None and after.start() < stop:
            stop, closed, pos = after.start(), False, after.start()
        if (cut := text.find(START, body, stop)) >= 0:  # the next header being written
            stop, closed = cut, False
        yield header.group("to"), body, stop, closed
        if pos >= len(text):
            return


def _bodies(text: str, final: bool, want: Collection[str | None]) -> list[str]:
    """The bodies of the messages to ``want`` (an open one's, so far, less what may still
    be framing at its end)."""
    out = []
    for to, body, stop, closed in messages(text):
        if to in want:
            out.append(text[body:stop] if closed or final else _safe(text[body:stop]))
    return out


def reasoning(text: str, final: bool) -> str | None:
    """The reasoning a text (so far) shows, its bodies one after the other (None: none),
    so a stream's pieces add up to the whole text's."""
    return "".join(_bodies(text, final, (SELF,))) or None


def content(text: str, final: bool) -> str:
    """The content a text (so far) shows: its answer messages', or, with no header at all,
    the whole text (once whole)."""
    if _HEADER.search(text) is None:
        return text if final else ""
    return "".join(_bodies(text, final, (USER, None)))


def calls(text: str, final: bool,
          names: Collection[str] = ()) -> list[tuple[int, int, str, dict[str, Any], None]]:  # fmt: skip
    """The calls complete in the tool channels of ``text`` (where each lies, its function
    and arguments), ``names`` the request's functions."""
    spans = [(body, stop) for to, body, stop, _ in messages(text) if to not in (SELF, USER, None)]
    if not spans and _HEADER.search(text) is None and any(a in text for a in _ATEM):
        spans = [(0, len(text))]  # no framing at all: the whole text
    out: list[tuple[int, int, str, dict[str, Any], None]] = []
    for body, stop in spans:
        for m in _INVOKE.finditer(text, body, stop):
            name = _NAME.search(m.group())
            if name is not None:
                args = {k: _value(v) for k, v in _PARAM.findall(m.group())}
                out.append((m.start(), m.end(), _named(name.group(1), names), args, None))
    return out


def call_start(text: str) -> int:
    """Where calls may begin: none are streamed as written (each comes whole)."""
    return len(text)


def _named(name: str, names: Collection[str]) -> str:
    """The function a call's name means: ``f.f`` is ``f`` where the request has ``f``
    (and not ``f.f``); any other name as written."""
    head, dot, tail = name.partition(".")
    return head if dot and head == tail and head in names and name not in names else name


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _safe(body: str) -> str:
    """An open body less what may still be framing at its end: a marker's start, a
    header's `` to=…`` (both: `` to=f<|mess``)."""
    while True:
        cut = body[: len(body) - max(held(body, t) for t in TOKENS)]
        m = _OPEN_TO.search(cut)
        cut = cut if m is None else cut[: m.start()]
        if cut == body:
            return body
        body = cut
