"""The tool-call formats read from the whole text each time: JSON calls after a marker or
as the whole text (``llama3_json``, ``mistral``, ``granite``, ``xlam``...), Python calls
(``pythonic``, ``olmo3``, ``lfm2``), harmony's and Command's, and the calls ``tool_choice``
``required`` or a named function constrains the text to."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, Final

from . import cohere, harmony, python_calls
from .tool_formats import APERTUS
from .tool_found import Found, Scan, decode, entry, parse_json, skip


def no_calls(text: str, final: bool) -> list[Found]:
    """No calls (no parser: the text is content)."""
    return []


def named(name: str) -> Scan:
    """The call of function ``name`` that is the text, its arguments a JSON object."""

    def scan(text: str, final: bool) -> list[Found]:
        i = skip(text, 0)
        got = decode(text, i)
        if got is None or not isinstance(got[0], dict):
            return []
        return [Found(0, got[1], name, got[0])]

    return scan


def required(text: str, final: bool) -> list[Found]:
    """The calls that are the text, a JSON array of ``{"name", "parameters"}`` objects."""
    i = skip(text, 0)
    if not text.startswith("[", i):
        return []
    return _from(0, _closed(text, _entries(text, i + 1, ",", "]")))


def _llama3_json(text: str, final: bool) -> list[Found]:
    start = i = skip(text, 0)
    if text.startswith("<|python_tag|>", i):
        i = skip(text, i + len("<|python_tag|>"))
    if not text.startswith("{", i):
        return []
    return _from(start, list(_entries(text, i, ";", None)))


_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def _after(marker: str, read: Callable[[str, int], list[Found]]) -> Scan:
    """Calls after each ``marker``, read from where its text goes on (``read``)."""

    def scan(text: str, final: bool) -> list[Found]:
        out: list[Found] = []
        at = text.find(marker)
        while at >= 0:
            i = skip(text, at + len(marker))
            nxt = text.find(marker, i)
            out += _from(at, read(text, i))
            at = nxt
        return out

    return scan


def _array(text: str, i: int) -> list[Found]:
    """The calls of a JSON array at ``i``."""
    return _closed(text, _entries(text, i + 1, ",", "]")) if text.startswith("[", i) else []


def _keyed_array(text: str, i: int) -> list[Found]:
    """The calls of a JSON array at ``i`` of objects ``{NAME: ARGUMENTS}`` (Apertus's)."""
    if not text.startswith("[", i):
        return []
    return _closed(text, _entries(text, i + 1, ",", "]", _keyed))


def _one(text: str, i: int) -> list[Found]:
    """The call that is the JSON object at ``i``, if complete and a call."""
    got = decode(text, i)
    found = None if got is None else entry(got[0], i, got[1])
    return [] if found is None else [found]


def _mistral_calls(text: str, i: int) -> list[Found]:
    """A JSON array of calls, or newer tokenizers' ``name[ARGS]{...}``."""
    if (m := _MISTRAL_NAME.match(text, i)) is None:
        return _array(text, i)
    got = decode(text, skip(text, m.end()))
    calls = [] if got is None else [Found(i, got[1], m.group(1), got[0])]
    return [f for f in calls if isinstance(f.args, dict)]


_XLAM: Final = re.compile(r"\A\s*(?=\[(?!TOOL_CALLS\]))|```(?:json)?|\[TOOL_CALLS\]|<tool_call>")
"""Where an ``xlam`` array may begin: the text's start, a fence, or a marker."""
_XLAM_CLOSE: Final = {"`": "```", "<": "</tool_call>"}


def _xlam(text: str, final: bool) -> list[Found]:
    """JSON arrays of calls where :data:`_XLAM` finds them (an array's closing fence or
    ``</tool_call>`` is its calls' markup); read up to an array not complete."""
    out: list[Found] = []
    at = 0
    while (m := _XLAM.search(text, at)) is not None:
        i = skip(text, m.end())
        if not text.startswith("[", i):
            at = m.end()
            continue
        found = _from(m.start(), _array(text, i))
        got = decode(text, i)
        if got is None:  # cut (or not JSON): what follows is not read
            return out + found
        at = got[1]
        close = _XLAM_CLOSE.get(m.group()[:1])
        if close is not None and text.startswith(close, skip(text, at)):
            at = skip(text, at) + len(close)
            if found:
                last = found[-1]
                found[-1] = Found(last.start, at, last.name, last.args)
        out += found
    return out


GIGACHAT: Final = re.compile(r"(?:<\|message_sep\|>\s*)?function call<\|role_sep\|>"
                              r"|<\|function_call\|>")  # fmt: skip
"""GigaChat 3's call header (its ``<|message_sep|>`` before it the calls' too), or 3.1's."""


def _gigachat3(text: str, final: bool) -> list[Found]:
    """A JSON call after each header (vLLM's reads the first)."""
    out: list[Found] = []
    at = 0
    while (m := GIGACHAT.search(text, at)) is not None:
        got = decode(text, skip(text, m.end()))
        found = None if got is None else entry(got[0], m.start(), got[1])
        if found is not None:
            out.append(found)
        at = m.end()  # (in a call's strings a header is followed by escaped quotes: no call)
    return out


def _python(read: Callable[[str], python_calls.Calls | None]) -> Scan:
    """Calls written in Python, where ``read`` finds them."""

    def scan(text: str, final: bool) -> list[Found]:
        got = read(text)
        if got is None:
            return []
        start, end, calls = got
        return [Found(start, end, name, args) for name, args in calls]

    return scan


def _lfm2(text: str, final: bool) -> list[Found]:
    """LFM2's list of calls in its first block, once closed (or the text whole); where the
    model echoes the calls after it, capped by another end marker, the echo is the calls'
    markup too (vLLM's leaves it out of the content)."""
    got = python_calls.read_marked(text, final)
    if got is None:
        return []
    start, end, calls = got
    if final and (last := text.rfind(python_calls.LFM2_END)) >= end:
        end = last + len(python_calls.LFM2_END)
    return [Found(start, end, name, args) for name, args in calls]


def openai_calls(text: str, final: bool) -> list[Found]:
    """Harmony messages to ``functions.NAME`` whose content is a JSON object, once ended
    (``<|call|>``, which ends the generation, is not in the text: the text's end)."""
    out: list[Found] = []
    for m in harmony.messages(text):
        name = m.call
        if name and m.body is not None and (m.closed or final):
            args = parse_json(text[m.body : m.end])
            if isinstance(args, dict):
                out.append(Found(m.at, m.after, name, args))
    return out


SCANNERS: Final[dict[str, Scan]] = {
    "mistral": _after("[TOOL_CALLS]", _mistral_calls),
    "granite": _after("<|tool_call|>", _array),
    "hunyuan_a13b": _after("<tool_calls>", _array),
    "minimax": _after("<tool_calls>", lambda text, i: list(_entries(text, i, None, "<"))),
    "phi4_mini_json": _after("functools", _array),
    "apertus": _after(APERTUS[0], _keyed_array),
    "xlam": _xlam,
    "openai": openai_calls,
    "llama3_json": _llama3_json,
    "pythonic": _python(python_calls.read_list),
    "olmo3": _python(python_calls.read_lines),
    "lfm2": _lfm2,
    "gigachat3": _gigachat3,
    "cohere_command3": lambda text, final: [Found(*c) for c in cohere.calls(text, final)],
    "cohere_command4": lambda text, final: [Found(*c) for c in cohere.calls(text, final)],
    "granite-20b-fc": _after("<function_call>", _one),
}
"""The parsers that read the whole text each time."""


def _entries(text: str, i: int, sep: str | None, close: str | None,
             read: Callable[[Any, int, int], Found | None] = entry) -> Iterator[Found]:  # fmt: skip
    """Calls written as complete JSON objects from ``i`` on, separated by ``sep`` (None:
    whitespace only), up to ``close`` or the first that is not complete (or not a call:
    left out, read on); each read by ``read``."""
    n = len(text)
    while True:
        i = skip(text, i)
        if i >= n or text[i] == close:
            return
        got = decode(text, i)
        if got is None:
            return
        value, end = got
        if (found := read(value, i, end)) is not None:
            yield found
        i = skip(text, end)
        if sep is None:
            continue
        if i >= n or text[i] != sep:
            return
        i += 1


def _closed(text: str, found: Iterator[Found]) -> list[Found]:
    """``found`` (read from an array), the last one's end moved past the array's ``]``."""
    out = list(found)
    if out:
        j = skip(text, out[-1].end)
        while text.startswith(",", j):  # entries that are not calls
            j = skip(text, j + 1)
            got = decode(text, j)
            if got is None:
                break
            j = skip(text, got[1])
        if text.startswith("]", j):
            last = out[-1]
            out[-1] = Found(last.start, j + 1, last.name, last.args)
    return out


def _from(start: int, found: list[Found]) -> list[Found]:
    """``found``, the first one's text taken to begin at ``start`` (a marker, a bracket)."""
    if found:
        first = found[0]
        found[0] = Found(start, first.end, first.name, first.args)
    return found


def _keyed(value: Any, start: int, end: int) -> Found | None:
    """A call ``{NAME: {...}}`` (its one key the name); None if ``value`` is not one."""
    if not (isinstance(value, dict) and len(value) == 1):
        return None
    ((name, args),) = value.items()
    return Found(start, end, name, args) if name and isinstance(args, dict) else None
