"""Tool calls streamed as OpenAI's ``delta.tool_calls``: each call's id and name once its
name is written, then its ``arguments`` piece by piece as the model writes them.

A :class:`CallReader` finds a call once its text is complete; :class:`CallChunks` also
follows the call being written (the *open* call): where its format has put its name and
begun its arguments (:func:`_opening`), its arguments so far, as compact JSON
(:mod:`.json_compact`): a JSON object's settled text (``hermes``, ``llama3_json``,
``mistral``, ``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``, ``internlm``, ``longcat``,
Cohere Command's, ``granite-20b-fc``'s, the arrays and lists after a marker (``apertus``'s
``{NAME: {...}}`` objects too), ``xlam``'s, ``gigachat3``'s, and ``tool_choice``
``required`` or a named function), or the parameters written whole (``qwen3_coder``,
``glm45``, ``seed_oss``, ``minimax_m2``, ``step3``, ``deepseek_v32``, ``deepseek_v4``,
``hy_v3``, ``solar_open2``, ``minicpm5``, ``minimax_m3``, each typed by its schema, ``mimo``'s strings,
``functiongemma``'s ``<escape>`` values and ``gemma4``'s pairs, each once ended), or, for ``pythonic``,
``olmo3`` and ``lfm2``, the keyword arguments written whole
(:class:`.python_calls.ArgsScanner`: a call is streamed whole at its ``)``, before the
list or block that holds it closes and is read). Calls written otherwise
(``arguments`` before ``name``, or as a JSON string) come whole, once complete. A parser's
other name (``tool_formats.ALIASES``) streams as the parser.

A call's chunks (``{"index", "id", "type", "function": {"name", "arguments"}}`` first,
then ``{"index", "function": {"arguments"}}``) add up to the call the result holds: the
same id, name and ``arguments`` text. ``index`` counts the calls streamed; a call the
model began but wrote so that it is not one (its result leaves it out) keeps its index,
and the next call takes the one after.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Final

from ...schemas.tools import ToolUse
from . import blocks, cohere, harmony, minimax_m3, python_calls, xtml
from .json_compact import Compactor, compact
from .python_calls import ArgsScanner
from .tagged_args import TYPED_ARGS, TypedArgs, Types, properties
from .tool_blocks import (
    BLOCKS,
    DOTS_INVOKE,
    GEMMA_CALL,
    HY_NAME,
    KNOWN_ONLY,
    MINICPM5_NAME,
    SECTIONED,
    SOLAR_NAME,
    STEP3_INVOKE,
    V32_INVOKE,
)
from .tool_formats import ALIASES, DS, KIMI, SECTIONS
from .tool_found import skip
from .tool_scans import GIGACHAT
from .tools import CallReader, new_id

_STRING: Final = r'"((?:[^"\\\n]|\\.){1,128})"'
_NAME: Final = r'"name"\s*:\s*' + _STRING
_CALL: Final = r"\{\s*" + _NAME + r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
"""A JSON call's start, up to its arguments' ``{`` (its name written first)."""
_KEYED: Final = r"\{\s*" + _STRING + r"\s*:\s*(?=\{)"
"""A keyed call's start (``{NAME: {...}}``, Apertus's), up to its arguments' ``{``."""
_SEP: Final = re.escape(DS[4])
_FUNCTION_OPEN: Final = re.compile(r"\s*<function=([^>\n]{1,64})>")
_AFTER_MARKER: Final[dict[str, re.Pattern[str]]] = {
    "hermes": re.compile(r"\s*" + _CALL),
    "qwen3_coder": _FUNCTION_OPEN,
    "seed_oss": _FUNCTION_OPEN,
    "minimax_m2": re.compile(r'\s*name="([^"\n]{1,64})"\s*>'),
    "internlm": re.compile(r"\s*" + _CALL),
    "longcat": re.compile(r"\s*" + _CALL),
    "step3": STEP3_INVOKE,
    "deepseek_v32": V32_INVOKE,
    "glm45": re.compile(r"\s*([^<\s][^<\n]{0,63}?)\s*(?=<arg_key>)"),
    "mimo": _FUNCTION_OPEN,
    "hy_v3": HY_NAME,
    "solar_open2": SOLAR_NAME,
    "dots": DOTS_INVOKE,
    "deepseek_v4": V32_INVOKE,
    "functiongemma": GEMMA_CALL,
    "gemma4": re.compile(r"call:([\w\-.]+)\{"),
    "minicpm5": MINICPM5_NAME,
    "kimi_k3": xtml.HEADER,
    "minimax_m3": minimax_m3.HEADER,
    "deepseek_v3": re.compile(r"\s*\w*\s*" + _SEP + r"\s*([^\n]{1,64}?)\s*\n```(?:json)?\s*(?=\{)"),
    "deepseek_v31": re.compile(r"\s*([^\n<]{1,64}?)\s*" + _SEP + r"\s*(?=\{)"),
    "kimi_k2": re.compile(
        r"\s*((?:functions\.)?([^\s:<]{1,64}):\d{1,6})\s*" + re.escape(KIMI[4]) + r"\s*(?=\{)"
    ),
}
"""How a block's call begins, after its opening marker (the name in group 1; ``kimi_k2``:
its id in group 1, its name in group 2)."""
_JSON_BLOCKS: Final = ("hermes", "internlm", "longcat")
"""The block formats whose call is a JSON object."""
_LLAMA: Final = re.compile(r"\s*(?:<\|python_tag\|>\s*)?(?:;\s*)?" + _CALL)
_IN_ARRAY: Final = re.compile(r"\s*[\[,]\s*" + _CALL)
_MISTRAL: Final = re.compile(r"\[TOOL_CALLS\]\s*(?:\[\s*" + _CALL + r"|([A-Za-z0-9_.-]{1,64})"
                             r"\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]\s*(?=\{))")  # fmt: skip
_LISTED: Final[dict[str, tuple[str, re.Pattern[str], re.Pattern[str]]]] = {
    "granite": ("<|tool_call|>", re.compile(r"<\|tool_call\|>\s*\[\s*" + _CALL), _IN_ARRAY),
    "hunyuan_a13b": ("<tool_calls>", re.compile(r"<tool_calls>\s*\[\s*" + _CALL), _IN_ARRAY),
    "minimax": ("<tool_calls>", re.compile(r"<tool_calls>\s*" + _CALL), re.compile(r"\s*" + _CALL)),
    "phi4_mini_json": ("functools", re.compile(r"functools\s*\[\s*" + _CALL), _IN_ARRAY),
    "apertus": (
        "<|tools_prefix|>",
        re.compile(r"<\|tools_prefix\|>\s*\[\s*" + _KEYED),
        re.compile(r"\s*,\s*" + _KEYED),
    ),
    "granite-20b-fc": (
        "<function_call>",
        re.compile(r"<function_call>\s*" + _CALL),
        re.compile(r"\s*<function_call>\s*" + _CALL),
    ),
}
"""The parsers whose calls follow a marker, one after another: the marker, how the
first call begins at it, and how a next one begins where the last ended."""
_XLAM: Final = re.compile(
    r"(?:\A\s*|```(?:json)?\s*|\[TOOL_CALLS\]\s*|<tool_call>\s*)\[\s*" + _CALL
)
"""How an ``xlam`` array's first call begins (at the text's start, a fence, a marker)."""
_NEXT: Final = re.compile(r"\s*,\s*" + _CALL)
_GIGACHAT_CALL: Final = re.compile(f"(?:{GIGACHAT.pattern})\\s*" + _CALL)
_PYTHON: Final = {"pythonic": python_calls.opening, "olmo3": python_calls.line_opening,
                   "lfm2": python_calls.marked_opening}  # fmt: skip
"""The formats of Python calls, and how a call being written begins."""


@dataclass(frozen=True, slots=True)
class _Opening:
    """Where a call being written stands: its name, and where its arguments begin."""

    at: int
    """Where its text begins (its block's marker, or its JSON object)."""
    name: str
    id: str | None
    """The model's own id (``kimi_k2``)."""
    args: int
    """Where its arguments begin: the JSON object's ``{``, or the first typed parameter."""


@dataclass(slots=True)
class _Open:
    """The call being streamed."""

    opening: _Opening
    index: int
    id: str
    json: Compactor | None
    """Its JSON arguments as they come (None: typed parameters, or Python's)."""
    py: ArgsScanner | None = None
    """Its Python keyword arguments as they come (``pythonic``)."""
    sent: str = ""
    """Its ``arguments`` streamed so far."""


@dataclass(slots=True)
class CallChunks:
    """One output's calls as OpenAI's ``delta.tool_calls`` chunks (see the module's
    docstring), read alongside its :class:`CallReader`."""

    reader: CallReader
    use: ToolUse
    parser: str | None
    types: Types = field(default_factory=dict)
    _done: int = 0
    """The reader's calls streamed whole."""
    _shift: int = 0
    """Streamed calls the result leaves out (each kept its index)."""
    _open: _Open | None = None
    _closed: list[_Open] = field(default_factory=list)
    """Calls streamed whole that the reader has not read yet (``pythonic``: the list's
    calls are read once it closes)."""
    _after: int = 0
    """Where the last of them ends (where the next may begin)."""

    def __post_init__(self) -> None:
        self.parser = ALIASES.get(self.parser or "", self.parser)

    def chunks(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The chunks since last asked, given the output's text so far (read by the
        reader first; ``final``: all of it)."""
        out: list[dict[str, Any]] = []
        calls = self.reader.calls
        for k in range(self._done, len(calls)):
            out += self._complete(k, calls[k])
        self._done = len(calls)
        if final:
            return out
        limit = self.reader.limit
        if limit is not None and len(calls) >= limit:
            return out
        if self._open is not None and self._abandoned(text):
            self._open = None
            self._shift += 1
        while True:
            if self._open is None:
                if limit is not None and len(calls) + len(self._closed) >= limit:
                    break
                if not self.reader.may_call(text):
                    break
                opening = _opening(self.use, self.parser, text, self._start(calls))
                if opening is None or (self.parser in KNOWN_ONLY and self.use.kind == "auto"
                                       and opening.name not in self.types):  # fmt: skip
                    break
                self._open = self._begin(opening, len(calls))
                out.append({"index": self._open.index, "id": self._open.id, "type": "function",
                            "function": {"name": opening.name, "arguments": ""}})  # fmt: skip
            o = self._open
            args = self._so_far(o, text)
            if len(args) > len(o.sent):
                out.append(_piece(o.index, args[len(o.sent) :]))
                o.sent = args
            if o.py is None or o.py.end is None:
                break
            self._closed.append(o)  # its ")": the next call may begin
            self._open, self._after = None, o.py.end
        return out

    def _start(self, calls: list[dict[str, Any]]) -> int:
        """Where the next call may begin: after the last call streamed whole or read."""
        read = self.reader.end if calls else 0
        return max(self._after, read) if self._closed or self.parser in _PYTHON else read

    def _begin(self, opening: _Opening, read: int) -> _Open:
        """The call that begins at ``opening``, ``read`` calls read before it."""
        index = read + len(self._closed) + self._shift
        cid = opening.id or new_id()
        auto = self.use.kind == "auto"
        if auto and self.parser in _PYTHON:
            return _Open(opening, index, cid, None, ArgsScanner(opening.args))
        typed = self._typed(opening.name) is not None
        return _Open(opening, index, cid, None if typed else Compactor())

    def _typed(self, name: str) -> TypedArgs | None:
        """How the call of ``name`` being written reads, where its parser types its
        values (a block format: where the function's schema is known)."""
        if self.use.kind != "auto":
            return None
        fmt = blocks.FORMATS.get(self.parser or "")
        if fmt is not None:
            typed = properties(self.types.get(name, {})) and fmt.typed_args
            return typed or None
        return TYPED_ARGS.get(self.parser or "")

    def _complete(self, k: int, call: dict[str, Any]) -> list[dict[str, Any]]:
        """Call ``k``, just read whole: the rest of it where it was being streamed, else
        all of it (under the next index)."""
        fn = call["function"]
        if self._closed:
            o: _Open | None = self._closed.pop(0)
        else:
            o, self._open = self._open, None
        if o is not None:
            if fn["name"] == o.opening.name and fn["arguments"].startswith(o.sent):
                call["id"] = o.id  # the id its first chunk gave
                rest = fn["arguments"][len(o.sent) :]
                return [_piece(o.index, rest)] if rest else []
            self._shift += 1  # what was streamed was not this call
            if call["id"] == o.id:
                call["id"] = new_id()
        return [{"index": k + self._shift, "id": call["id"], "type": "function",
                 "function": {"name": fn["name"], "arguments": fn["arguments"]}}]  # fmt: skip

    def _so_far(self, o: _Open, text: str) -> str:
        if o.py is not None:
            return compact(o.py.feed(text))[:-1]  # without the closing brace: more may come
        if o.json is not None:
            o.json.feed(text[o.opening.args :])
            return o.json.text
        args = self._typed(o.opening.name)
        assert args is not None
        if self.parser in BLOCKS:  # its block's parameters only (it may be read later)
            cut = text.find(BLOCKS[self.parser][1], o.opening.args)
            text = text if cut < 0 else text[:cut]
        got = args(text, o.opening.args, self.types.get(o.opening.name, {}))
        return compact(got)[:-1]  # without the closing brace: more may come

    def _abandoned(self, text: str) -> bool:
        """Whether the open call's block closed without making a call."""
        assert self._open is not None
        if self.use.kind != "auto" or self.parser not in BLOCKS:
            return False
        opening, closing, _ = BLOCKS[self.parser]
        if self.parser in SECTIONED:  # its blocks count once their section closes
            closing = SECTIONS[self.parser][1]
        return text.find(closing, self._open.opening.at + len(opening)) >= 0


def _piece(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def _opening(use: ToolUse, parser: str | None, text: str, start: int) -> _Opening | None:
    """The call being written after ``start`` (where the last call read ends), where its
    name is written and its arguments begun."""
    if parser == "openai":  # harmony calls, whatever the tool choice
        return _harmony_call(text, start)
    if parser in cohere.FORMATS or parser in blocks.FORMATS:
        fmt = blocks.FORMATS.get(parser or "")
        opened = cohere.opening(text, start) if fmt is None else fmt.opening(text, start)
        return None if opened is None else _Opening(*opened)
    if use.kind == "named":
        assert use.name is not None
        m = re.compile(r"\s*(?=\{)").match(text, start)
        return None if m is None or start else _Opening(0, use.name, None, m.end())
    if use.kind == "required":
        return _json_call(_IN_ARRAY.match(text, start))
    if parser in _AFTER_MARKER:
        marker, closing, _ = BLOCKS[parser]
        at = text.rfind(marker, start)
        if at < 0 or text.find(closing, at) >= 0:
            return None
        if parser in SECTIONED and not 0 <= text.find(SECTIONS[parser][0]) < at:
            return None  # a block outside its section is no call
        m = _AFTER_MARKER[parser].match(text, at + len(marker))
        if m is None:
            return None
        if parser == "kimi_k2":
            return _Opening(at, m.group(2), m.group(1), m.end())
        if parser == "kimi_k3":
            return _Opening(at, xtml.name(m), None, m.end()) if xtml.name(m) else None
        if parser in _JSON_BLOCKS:
            return _json_call(m, at)
        return _Opening(at, m.group(1).strip(), None, m.end())
    if parser == "llama3_json":
        return _json_call(_LLAMA.match(text, start))
    if parser == "xlam":
        got = _json_call(_NEXT.match(text, start)) if start else None
        return got or _json_call(_XLAM.search(text, start))
    if parser in _LISTED:
        marker, first, then = _LISTED[parser]
        got = _json_call(then.match(text, start)) if start else None
        at = text.rfind(marker, start)
        if got is not None or at < 0:
            return got
        return _json_call(first.match(text, at), at)
    if parser == "mistral":
        got = _json_call(_IN_ARRAY.match(text, start)) if start else None
        at = text.rfind("[TOOL_CALLS]", start)
        if got is not None or at < 0:
            return got
        m = _MISTRAL.match(text, at)
        if m is None or m.group(1) is not None:
            return _json_call(m, at)
        return _Opening(at, m.group(2), None, m.end())
    if parser == "gigachat3":
        return _json_call(_GIGACHAT_CALL.search(text, start))
    if parser in _PYTHON:
        py = _PYTHON[parser](text, start)
        return None if py is None else _Opening(py[0], py[1], None, py[2])
    return None


def _harmony_call(text: str, start: int) -> _Opening | None:
    """The harmony message to a function being written from ``start``, once its
    arguments' ``{`` is."""
    for msg in harmony.messages(text, start):
        if msg.body is None:
            return None
        if msg.call:
            at = skip(text, msg.body)
            return _Opening(msg.at, msg.call, None, at) if text.startswith("{", at) else None
    return None


def _json_call(m: re.Match[str] | None, at: int | None = None) -> _Opening | None:
    """A JSON call's opening from a match of :data:`_CALL` (its name in group 1)."""
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    return _Opening(m.start() if at is None else at, name, None, m.end())
