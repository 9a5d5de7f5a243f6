"""Cohere Command's text read as Cohere's melody filter reads it (vLLM's
``cohere_command3`` and ``cohere_command4`` reasoning and tool parsers hand it to
``cohere_melody``).

A Command model writes its text in modes, switched by markers (special tokens):
``<|START_THINKING|>`` begins the *reasoning*, ``<|END_THINKING|>`` the *answer*,
``<|START_RESPONSE|>`` (Command 4 also ``<|START_TEXT|>``) the answer too,
``<|START_ACTION|>`` the *calls*; ``<|END_RESPONSE|>``, ``<|END_TEXT|>`` and
``<|END_ACTION|>`` begin text that is *ignored* (up to the next marker). Every marker
switches, wherever it is (melody's mode machine: a call written while thinking is a
call). Command 3's text begins in the answer, Command 4's in the reasoning (its prompt
opens it) unless the prompt's end says otherwise (:func:`begins`). Here:

- the *reasoning* (``reasoning_content``) is the reasoning's parts, each trimmed,
  joined (melody trims them left and right), None where there are none;
- the *content* is the answer's parts, each trimmed at its right (melody drops the
  whitespace before a marker), joined, trimmed;
- in both, citations are left out as melody's do: ``<co>`` (or ``<co: …>``) …
  ``</co: 0:[1]>`` keeps the text between its tags (an opening tag whose citation the
  text cuts keeps its text too; a closing tag with no opening one is text);
- the *calls* (:func:`calls`) are the JSON objects of the calls' parts, each a list
  ``[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}, …]``, once
  complete; a call's id is the model's ``tool_call_id`` (its template writes it back in
  later turns, as vLLM's keeps it).

Read so far (``final`` false), what may be a marker or a citation's tag being written at
the end is held back, so the reasoning and content shown are always a start of the whole
text's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from .json_compact import DECODER

START_THINKING, END_THINKING = "<|START_THINKING|>", "<|END_THINKING|>"
START_RESPONSE, END_RESPONSE = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
START_TEXT, END_TEXT = "<|START_TEXT|>", "<|END_TEXT|>"
START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
THINKING, ANSWER, ACTION, IGNORED = "thinking", "answer", "action", "ignored"
"""The modes a text's parts are written in."""

_COMMON: Final = {START_THINKING: THINKING, END_THINKING: ANSWER, START_RESPONSE: ANSWER,
                  END_RESPONSE: IGNORED, START_ACTION: ACTION, END_ACTION: IGNORED}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Format:
    """One Command generation's markers: the mode each begins, and the mode a text begins
    in where the prompt does not tell."""

    name: str
    modes: dict[str, str]
    begins: str
    answer_tag: str
    """The marker a structured answer follows (where a response's constraint begins)."""

    @property
    def tokens(self) -> tuple[str, ...]:
        """Its markers: kept in the texts its parsers read."""
        return tuple(self.modes)


_CMD4: Final = {**_COMMON, START_TEXT: ANSWER, END_TEXT: IGNORED}
FORMATS: Final = {
    "cohere_command3": Format("cohere_command3", _COMMON, ANSWER, START_RESPONSE),
    "cohere_command4": Format("cohere_command4", _CMD4, THINKING, START_TEXT),
}
"""The formats, by their parsers' names (vLLM's, for both its reasoning and tool
parsers)."""
TOKENS: Final = FORMATS["cohere_command4"].tokens
"""Every format's markers."""


@dataclass(frozen=True, slots=True)
class Part:
    """A run of a text in one mode."""

    mode: str
    start: int
    end: int
    """Where its text ends (before the next marker; the text's end, less what may be a
    marker being written, while it is written)."""
    closed: bool
    """A marker ended it (what it shows is settled)."""


def begins(fmt: Format, thinking: bool | None) -> str:
    """The mode a text begins in, given whether its prompt opened the reasoning (True:
    it ends with ``<|START_THINKING|>``), closed it (False: it opened the answer), or
    tells nothing (None: the format's own start)."""
    return fmt.begins if thinking is None else THINKING if thinking else ANSWER


def parts(text: str, fmt: Format, mode: str, final: bool) -> list[Part]:
    """The parts of ``text``, the first in ``mode``; ``final``: the text is whole (so far,
    what may be a marker's start at its end is held back)."""
    out: list[Part] = []
    at = 0
    for m in _pattern(fmt).finditer(text):
        if m.start() > at:
            out.append(Part(mode, at, m.start(), True))
        mode, at = fmt.modes[m.group()], m.end()
    end = len(text) if final else len(text) - _held(text, fmt.tokens, at)
    if end > at:
        out.append(Part(mode, at, end, final))
    return out


def reasoning(text: str, fmt: Format, mode: str, final: bool) -> str | None:
    """The reasoning a text (so far) shows (None: none)."""
    got = "".join(uncite(text[p.start : p.end], p.closed).strip()
                  for p in parts(text, fmt, mode, final) if p.mode == THINKING)  # fmt: skip
    return got or None


def content(text: str, fmt: Format, mode: str, final: bool) -> str:
    """The content a text (so far) shows."""
    got = "".join(uncite(text[p.start : p.end], p.closed).rstrip()
                  for p in parts(text, fmt, mode, final) if p.mode == ANSWER)  # fmt: skip
    return got.lstrip()


_OPEN: Final = re.compile(r"<co(?:: [^<>]{0,64})?>")
_CLOSE: Final = re.compile(r"</co: [^<>]{0,64}>")
_OPENING: Final = re.compile(r"<(?:c(?:o(?::(?: [^<>]{0,64})?)?)?)?\Z")
_CLOSING: Final = re.compile(r"<(?:/(?:c(?:o(?::(?: [^<>]{0,64})?)?)?)?)?\Z")
"""What may be an opening or closing tag being written, at a text's end."""


def uncite(text: str, final: bool) -> str:
    """``text`` without its citations' tags (so far: less what may be one being
    written)."""
    out: list[str] = []
    at, inside = 0, False
    while True:
        m = (_CLOSE if inside else _OPEN).search(text, at)
        if m is None:
            rest = text[at:]
            if not final and (cut := (_CLOSING if inside else _OPENING).search(rest)):
                rest = rest[: cut.start()]
            out.append(rest)
            return "".join(out)
        out.append(text[at : m.start()])
        at, inside = m.end(), not inside


def calls(text: str, final: bool) -> list[tuple[int, int, str, dict[str, Any], str | None]]:
    """The calls complete in ``text``'s calls parts, each where its object lies, its
    function, its arguments and its id (the format's calls do not depend on where the
    text begins: ``<|START_ACTION|>`` begins them)."""
    out: list[tuple[int, int, str, dict[str, Any], str | None]] = []
    fmt = FORMATS["cohere_command4"]  # every marker, so that a part ends at any
    for p in parts(text, fmt, ANSWER, final):
        if p.mode != ACTION:
            continue
        i = _skip(text, p.start, p.end)
        if not text.startswith("[", i):
            continue
        i += 1
        while (i := _skip(text, i, p.end)) < p.end and text[i] != "]":
            try:
                value, end = DECODER.raw_decode(text[: p.end], i)
            except (ValueError, RecursionError):
                break  # cut, or not JSON
            if (call := _call(value)) is not None:
                out.append((i, end, *call))
            i = _skip(text, end, p.end)
            if not text.startswith(",", i):
                break
            i += 1
    return out


def _call(value: Any) -> tuple[str, dict[str, Any], str | None] | None:
    """A call's function, arguments and id (None: ``value`` is no call)."""
    if not isinstance(value, dict):
        return None
    name, args, cid = value.get("tool_name"), value.get("parameters", {}), value.get("tool_call_id")
    if not (isinstance(name, str) and name and isinstance(args, dict)):
        return None
    return name, args, str(cid) if isinstance(cid, (str, int)) and str(cid) else None


_OPENED: Final = re.compile(r'\{\s*"tool_call_id"\s*:\s*"((?:[^"\\\n]|\\.){1,64})"\s*,\s*'
                            r'"tool_name"\s*:\s*"((?:[^"\\\n]|\\.){1,128})"\s*,\s*'
                            r'"parameters"\s*:\s*(?=\{)')  # fmt: skip
"""A call's start as Command writes it, up to its arguments' ``{``."""


def opening(text: str, start: int) -> tuple[int, str, str, int] | None:
    """The call being written in a calls part after ``start``, once its name is and its
    arguments are begun: where it begins, its function, its id, where its arguments
    begin."""
    for p in parts(text, FORMATS["cohere_command4"], ANSWER, False):
        if p.mode != ACTION or p.end <= start:
            continue
        m = _OPENED.search(text, max(p.start, start), p.end)
        if m is not None:
            try:
                cid, name = json.loads(f'"{m.group(1)}"'), json.loads(f'"{m.group(2)}"')
            except ValueError:
                return None
            return m.start(), name, cid, m.end()
    return None


def calls_grammar(fmt: Format, mode: str, functions: Sequence[tuple[str, dict[str, Any]]],
                  parallel: bool) -> str:  # fmt: skip
    """A Lark grammar (llguidance's) for a text that calls ``functions`` (each a name and
    its parameters' JSON Schema) as Command does, for the calls ``tool_choice``
    ``required`` or a named function asks for: its reasoning free (where the text begins
    in ``mode``: a reasoning part, or none or one opened with ``<|START_THINKING|>``),
    then a calls part, a list of compact call objects (one, unless ``parallel``), each
    with a numeric id, the function's name, and the arguments its schema allows. The
    markers are the tokenizer's special tokens, which free text cannot write."""
    think = (f"TEXT? {END_THINKING}" if mode == THINKING
             else f"({START_THINKING} TEXT? {END_THINKING})?")  # fmt: skip
    return "\n".join([f"start: {think} {START_ACTION} calls {END_ACTION}",
                      *_calls_rules([(n, s, True) for n, s in functions], parallel)])  # fmt: skip


def auto_grammar(fmt: Format, functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
                 parallel: bool) -> str:  # fmt: skip
    """A Lark grammar for a Command text under ``tool_choice`` ``auto`` with ``strict``
    functions (each a name, its parameters' JSON Schema, whether strict): its modes as
    free as ever (every marker but ``<|START_ACTION|>`` anywhere), but a calls part is a
    list of compact call objects of ``functions`` (a strict function's arguments as its
    schema allows, another's any object), ended by ``<|END_ACTION|>``; one calls part of
    one call, unless ``parallel``."""
    marks = " | ".join(m for m in fmt.tokens if m != START_ACTION)
    return "\n".join([
        "start: free (action free)" + ("*" if parallel else "?"),
        "free: TEXT? (mark TEXT?)*",
        f"mark: {marks}",
        f"action: {START_ACTION} calls {END_ACTION}",
        *_calls_rules(functions, parallel),
    ])  # fmt: skip


def _calls_rules(functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
                 parallel: bool) -> list[str]:  # fmt: skip
    """The rules of a calls part's list (``calls``): compact call objects, each with a
    numeric id, its function's name, and its arguments (a strict function's as its
    schema allows, another's any object); free text (``TEXT``), which cannot write a
    special token."""
    more = ' ("," call)*' if parallel else ""
    rules = [
        f'calls: "[" call{more} "]"',
        "call: " + " | ".join(f"call_{k}" for k in range(len(functions))),
        r"TEXT: /(.|\n)+/",
    ]
    for k, (name, params, strict) in enumerate(functions):
        obj = {
            "type": "object",
            "properties": {"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,6}$"},
                           "tool_name": {"const": name},
                           "parameters": params if strict and params else {"type": "object"}},
            "required": ["tool_call_id", "tool_name", "parameters"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},
        }  # fmt: skip
        rules.append(f"call_{k}: %json {json.dumps(obj)}")
    return rules


def _pattern(fmt: Format) -> re.Pattern[str]:
    return _PATTERNS[fmt.name]


_PATTERNS: Final = {n: re.compile("|".join(map(re.escape, f.modes))) for n, f in FORMATS.items()}


def _held(text: str, markers: tuple[str, ...], at: int) -> int:
    """How many characters at the end of ``text`` (from ``at`` on) may begin one of
    ``markers``."""
    tail = text[at:]
    return max((n for m in markers for n in range(1, min(len(m), len(tail) + 1))
                if tail.endswith(m[:n])), default=0)  # fmt: skip


def _skip(text: str, i: int, end: int) -> int:
    while i < end and text[i].isspace():
        i += 1
    return i
