"""Inkling's text read as vLLM's ``inkling`` parser reads it (its reasoning and tool
parsers are one engine).

Inkling writes typed blocks, each opened by a special token and ended by
``<|end_message|>`` (or ``<|content_model_end_sampling|>``), in any order and as often as
it likes::

    <|message_model|><|content_thinking|>…reasoning…<|end_message|>
    <|message_model|><|content_text|>…visible text…<|end_message|>
    <|message_model|><|content_invoke_tool_json|>{"name": …, "args": {…}}<|end_message|>

A block's marker switches what its text is, from any place (its mode, :data:`_MOVES`): the
reasoning (``<|content_thinking|>``), the answer (``<|content_text|>``; a raw or error tool
block, ``<|content_invoke_tool_text|>`` and ``<|content_tool_error|>``, shows as text too),
or a call (``<|content_invoke_tool_json|>``); an end marker returns to the answer.
``<|message_model|>`` opens a *header*: text there (a function's name, say) is left out
where a block's marker follows, and is answer where an end marker (or the text's end)
does. A marker that switches nothing where it stands (the answer's marker in the
reasoning, any but an end in a call) is text, as vLLM's engine keeps it. The text begins
in a header (the prompt wrote ``<|message_model|>``), or where the prompt's last marker
left it (:func:`opens`).

- the reasoning is the reasoning blocks', each less its trailing whitespace, joined;
- the content is the answer's text, joined; where calls were made, whitespace only is none;
- a call is its block's JSON object ``{"name": …, "args": {…}}`` (``arguments`` or
  ``parameters`` for ``args``; none: ``{}``), its values coerced to the function's
  schema as vLLM's engine does (:mod:`.coerce`: ``"5"`` where an integer is due is ``5``);
  a block that is no such object is content (its text shown as written).

Read so far, what may be a marker being written, a header not settled yet, a call block
not closed yet (and the answer after it; its arguments stream a member at a time, once
the next ``,`` or the closing ``}`` settles it, :func:`settled`), the reasoning's trailing whitespace and an answer
that is whitespace only so far are held back, so that what is shown only grows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .coerce import coerce_args
from .json_compact import DECODER, Pairs
from .reasoning import held
from .tagged_args import properties
from .tool_found import decode, skip

MESSAGE_MODEL: Final = "<|message_model|>"
TEXT: Final = "<|content_text|>"
THINKING: Final = "<|content_thinking|>"
TOOL_JSON: Final = "<|content_invoke_tool_json|>"
TOOL_TEXT: Final = "<|content_invoke_tool_text|>"
TOOL_ERROR: Final = "<|content_tool_error|>"
END_SAMPLING: Final = "<|content_model_end_sampling|>"
END: Final = "<|end_message|>"
TOKENS: Final = (MESSAGE_MODEL, TEXT, THINKING, TOOL_JSON, TOOL_TEXT, TOOL_ERROR,
                 END_SAMPLING, END)  # fmt: skip
"""Its markers (special tokens, kept in the text it reads)."""

HEADER, ANSWER, REASONING, CALL = "header", "answer", "reasoning", "call"
_OPENERS: Final = {TEXT: ANSWER, THINKING: REASONING, TOOL_JSON: CALL, TOOL_TEXT: ANSWER,
                   TOOL_ERROR: ANSWER, MESSAGE_MODEL: HEADER}  # fmt: skip
_MOVES: Final[dict[tuple[str, str], str]] = {
    **{(mode, m): to for mode in (HEADER, ANSWER) for m, to in _OPENERS.items()},
    (REASONING, THINKING): REASONING,
    (REASONING, TOOL_JSON): CALL,
    **{(mode, end): ANSWER for mode in (HEADER, ANSWER, REASONING, CALL)
       for end in (END, END_SAMPLING)},
}  # fmt: skip
"""Where each marker leads from each mode (vLLM's transitions); a marker with no move
where it stands is text."""
_MARKER: Final = re.compile("|".join(map(re.escape, TOKENS)))


@dataclass(frozen=True, slots=True)
class Part:
    """A run of a text in one mode."""

    mode: str
    start: int
    end: int
    closed: bool
    """A marker ended it."""
    to: str = ""
    """Where the marker that ended it leads (a header's fate)."""


def opens(prompt_end: str) -> bool | None:
    """Where a text after a prompt ending ``prompt_end`` begins: in the reasoning (True:
    its last marker is ``<|content_thinking|>``), the answer (False:
    ``<|content_text|>``), or a header (None)."""
    last = max(((prompt_end.rfind(m), m) for m in TOKENS), default=(-1, ""))
    return {THINKING: True, TEXT: False}.get(last[1]) if last[0] >= 0 else None


def parts(text: str, thinking: bool | None, final: bool) -> list[Part]:
    """The parts of ``text``, the first in the mode ``thinking`` tells (:func:`opens`);
    so far (not ``final``), less what may be a marker being written at its end."""
    mode = HEADER if thinking is None else REASONING if thinking else ANSWER
    out: list[Part] = []
    at = 0
    for m in _MARKER.finditer(text):
        to = _MOVES.get((mode, m.group()))
        if to is None:
            continue  # text where it stands
        out.append(Part(mode, at, m.start(), True, to))
        mode, at = to, m.end()
    end = len(text) if final else len(text) - _held(text, at)
    out.append(
        Part(mode, at, max(end, at), final, ANSWER if final else "")
    )  # the end: as an end marker
    return out


def reasoning(text: str, thinking: bool | None, final: bool) -> str | None:
    """The reasoning a text (so far) shows (None: none)."""
    got = "".join(text[p.start : p.end].rstrip() for p in parts(text, thinking, final)
                  if p.mode == REASONING)  # fmt: skip
    return got or None


def content(text: str, thinking: bool | None, final: bool) -> str:
    """The content a text (so far) shows."""
    shown: list[str] = []
    called = False
    for p in parts(text, thinking, final):
        body = text[p.start : p.end]
        if p.mode == CALL:
            if not p.closed:
                break  # a call or text: not known yet
            if _call(body) is not None:
                called = True
                continue
            shown.append(body)
        elif p.mode == ANSWER or (p.mode == HEADER and _shown(p)):
            shown.append(body)
        elif p.mode == HEADER and not p.closed:
            break  # left out or shown: not known yet
    got = "".join(shown)
    if not got.strip() and (called or not final):
        return ""
    return got


def calls(text: str, final: bool, types: Mapping[str, dict[str, str]] | None = None,
          ) -> list[tuple[int, int, str, dict[str, Any], None]]:  # fmt: skip
    """The calls of the call blocks complete in ``text`` (where each object lies, its
    function and arguments, coerced by its schema where ``types`` has it); their reading
    does not depend on where the text begins."""
    out: list[tuple[int, int, str, dict[str, Any], None]] = []
    for p in parts(text, None, final):
        if p.mode == CALL and p.closed and (got := _call(text[p.start : p.end])) is not None:
            lead = len(text[p.start : p.end]) - len(text[p.start : p.end].lstrip())
            name, args = got
            props = properties((types or {}).get(name, {}))
            out.append((p.start + lead, p.end, name, coerce_args(args, props), None))
    return out


def settled(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The members of the arguments object at ``at`` (its ``{``) written whole so far,
    each followed by ``,`` or the closing ``}`` (a number may still grow before them),
    coerced by the function's schema (``known``, its :data:`.tagged_args.Types` entry)."""
    pairs: list[tuple[str, Any]] = []
    i = skip(text, at + 1)
    while i < len(text) and text[i] != "}":
        key = decode(text, i)
        if key is None or not isinstance(key[0], str):
            break
        i = skip(text, key[1])
        value = decode(text, skip(text, i + 1)) if text.startswith(":", i) else None
        if value is None:
            break
        i = skip(text, value[1])
        if i >= len(text) or text[i] not in ",}":
            break
        pairs.append((key[0], value[0]))
        if text[i] == "}":
            break
        i = skip(text, i + 1)
    return coerce_args(Pairs(pairs), properties(known))


_OPENED: Final = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.){1,128})"\s*,\s*'
                            r'"(?:args|arguments|parameters)"\s*:\s*(?=\{)')  # fmt: skip
"""A call's start as Inkling writes it, up to its arguments' ``{``."""


def opening(text: str, start: int) -> tuple[int, str, None, int] | None:
    """The call being written after ``start``, once its name is and its arguments are
    begun: where it begins, its function, no id, where its arguments begin."""
    last = parts(text, None, False)[-1]
    if last.mode != CALL or last.start < start:
        return None
    m = _OPENED.match(text, last.start)
    if m is None:
        return None
    try:
        name = DECODER.decode(f'"{m.group(1)}"')
    except ValueError:
        return None
    return last.start, name, None, m.end()


def call_start(text: str) -> int:
    """Where the first call block may begin (its marker; the text's end: none)."""
    at = text.find(TOOL_JSON)
    return at if at >= 0 else len(text) - _held(text, 0)


def _call(body: str) -> tuple[str, dict[str, Any]] | None:
    """A call block's function and arguments (None: the block is no call)."""
    try:
        value = DECODER.decode(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or not name:
        return None
    key = next((k for k in ("args", "arguments", "parameters") if k in value), None)
    args = {} if key is None else value[key]
    if isinstance(args, str):
        try:
            args = DECODER.decode(args)
        except (ValueError, RecursionError):
            return None
    return (name, args) if isinstance(args, dict) else None


def _shown(p: Part) -> bool:
    """Whether a header's text is answer: an end marker (or the text's end) ended it."""
    return p.to == ANSWER


def _held(text: str, at: int) -> int:
    """How many characters at the end of ``text`` (from ``at`` on) may begin a marker."""
    return max(held(text[at:], m) for m in TOKENS)
