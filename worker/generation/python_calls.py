"""Tool calls written as a Python list of calls with keyword arguments (the ``pythonic``
parser's format, Llama 3.2 and 4): ``[get_weather(city="Paris", days=2), get_time()]``,
in an optional ``<|python_start|>`` … ``<|python_end|>``; or, ``olmo3``'s (OLMo 3), a
call a line in ``<function_calls>`` … ``</function_calls>``; or, ``lfm2``'s (LiquidAI
LFM2), a list in ``<|tool_call_start|>`` … ``<|tool_call_end|>``, text around it.

A whole list (or block) is read with :mod:`ast`: literals only (JSON's ``true``, ``false``
and ``null`` too), nothing is evaluated (:func:`read_list`, :func:`read_lines`). As it is
written, a call is followed by an :class:`ArgsScanner`: each keyword argument counts once
a comma or the call's closing parenthesis outside any string or bracket ends it, so a
call's arguments stream one argument at a time (:mod:`.tool_chunks`), each as the whole
list will read it.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any, Final

from .json_compact import Pairs

START, END = "<|python_start|>", "<|python_end|>"
OPEN, CLOSE = "<function_calls>", "</function_calls>"
LFM2_START, LFM2_END = "<|tool_call_start|>", "<|tool_call_end|>"
_NAME: Final = r"([A-Za-z_][\w.]{0,63})\s*\("
_FIRST: Final = re.compile(r"\s*(?:" + re.escape(START) + r"\s*)?\[\s*" + _NAME)
_NEXT: Final = re.compile(r"\s*,\s*" + _NAME)
_FIRST_LINE: Final = re.compile(re.escape(OPEN) + r"\s*" + _NAME)
_NEXT_LINE: Final = re.compile(r"[^\S\n]*\n\s*" + _NAME)
_FIRST_MARKED: Final = re.compile(re.escape(LFM2_START) + r"\s*\[\s*" + _NAME)
Calls = tuple[int, int, list[tuple[str, dict[str, Any]]]]
"""Where a text's calls begin and end, and each call's name and arguments."""
_NAMES: Final[dict[str, Any]] = {"true": True, "false": False, "null": None,
                                 "True": True, "False": False, "None": None}  # fmt: skip


def read_list(text: str) -> Calls | None:
    """A text that is a list of calls: where it begins, where it ends (after its ``]``,
    or its ``<|python_end|>``), and its calls, each a name and its arguments (None: the
    text is not one, or not yet)."""
    start = i = _skip(text, 0)
    if text.startswith(START, i):
        i = _skip(text, i + len(START))
    j = text.rfind("]")
    if not text.startswith("[", i) or j < i:
        return None
    calls = _calls(text[i : j + 1])
    if calls is None:
        return None
    end = _skip(text, j + 1)
    end = end + len(END) if text.startswith(END, end) else j + 1
    return start, end, calls


def read_lines(text: str) -> Calls | None:
    """OLMo 3's calls: its first ``<function_calls>`` block, once closed, a call a line
    (vLLM's: the lines joined into a list): where the block begins, where it ends, and its
    calls (None: no closed block, or one that is not calls)."""
    start = text.find(OPEN)
    end = text.find(CLOSE, start) if start >= 0 else -1
    if end < 0:
        return None
    lines = [line.strip() for line in text[start + len(OPEN) : end].splitlines()]
    calls = _calls("[" + ", ".join(line for line in lines if line) + "]")
    return (start, end + len(CLOSE), calls) if calls else None


def read_marked(text: str, final: bool) -> Calls | None:
    """LFM2's calls: the list in its first ``<|tool_call_start|>`` block, once the block is
    closed (or, ``final``, the text is whole): where the block begins, where it ends, and
    its calls (None: no such block, or one that is not a list of calls)."""
    start = text.find(LFM2_START)
    end = text.find(LFM2_END, start) if start >= 0 else -1
    if start < 0 or (end < 0 and not final):
        return None
    body = text[start + len(LFM2_START) : len(text) if end < 0 else end].strip()
    calls = _calls(body) if body.startswith("[") and body.endswith("]") else None
    return (start, len(text) if end < 0 else end + len(LFM2_END), calls) if calls else None


def _calls(source: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of a Python list's ``source`` (None: it is not a list of calls)."""
    try:
        tree = ast.parse(source, mode="eval")
        if not isinstance(tree.body, ast.List):
            return None
        return [call_of(node) for node in tree.body.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def call_of(node: ast.expr) -> tuple[str, dict[str, Any]]:
    """A call node's (dotted) name and keyword arguments (ValueError: it is not a call
    with literal keyword arguments only)."""
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    parts: list[str] = []
    func: ast.expr = node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise ValueError("not a named function")
    parts.append(func.id)
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**arguments")
        args[kw.arg] = literal(kw.value)
    return ".".join(reversed(parts)), args


def literal(node: ast.expr) -> Any:
    """A JSON value written as a Python (or JSON) literal."""
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("not a finite number")
        if v is None or isinstance(v, str | int | float):
            return v
        raise ValueError("not a JSON value")
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise ValueError("a key that is not a string")
            out[key.value] = literal(item)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        number = literal(node.operand)
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ValueError("a sign on what is not a number")
        return -number if isinstance(node.op, ast.USub) else number
    raise ValueError("not a literal")


def opening(text: str, start: int) -> tuple[int, str, int] | None:
    """The call being written at ``start`` (0: the list's first; else where the call
    before it ended): where its text begins, its name, and where its arguments begin
    (after its ``(``); None: no call's name and ``(`` there yet."""
    m = (_NEXT if start else _FIRST).match(text, start)
    return None if m is None else (m.start(1), m.group(1), m.end())


def line_opening(text: str, start: int) -> tuple[int, str, int] | None:
    """:func:`opening` for OLMo 3's block: its first call, or one on a line of its own
    after the call that ended at ``start``, while the block is open."""
    return _block_opening(text, start, (OPEN, CLOSE), _FIRST_LINE, _NEXT_LINE)


def marked_opening(text: str, start: int) -> tuple[int, str, int] | None:
    """:func:`opening` for LFM2's block: its list's first call, or the next one in it
    after the call that ended at ``start``, while the block is open."""
    return _block_opening(text, start, (LFM2_START, LFM2_END), _FIRST_MARKED, _NEXT)


def _block_opening(text: str, start: int, block: tuple[str, str], first: re.Pattern[str],
                   then: re.Pattern[str]) -> tuple[int, str, int] | None:  # fmt: skip
    """:func:`opening` in the first ``block`` (its markers), while it is open: its first
    call as ``first`` finds it at the block's start, or as ``then`` finds the next one
    where the call before ended (``start``)."""
    at = text.find(block[0])
    if at < 0 or 0 <= text.find(block[1], at) < start:
        return None
    m = first.match(text, at) if start <= at else then.match(text, start)
    return None if m is None else (m.start(1), m.group(1), m.end())


class ArgsScanner:
    """One call's keyword arguments as the text comes (each text given is the one before
    and more): those written whole, and where the call ends."""

    __slots__ = ("_at", "_depth", "_quote", "_segment", "end", "failed", "pairs")

    def __init__(self, at: int) -> None:
        self._at = self._segment = at
        self._depth = 0
        self._quote = ""
        """The open string's quote (``'``, ``"``, or tripled; "": none open)."""
        self.pairs: list[tuple[str, Any]] = []
        """The arguments written whole, in order."""
        self.end: int | None = None
        """Where the call ends, after its ``)`` (None: still open)."""
        self.failed = False
        """An argument is not a keyword argument with a literal value: no more count."""

    def feed(self, text: str) -> Pairs:
        """Read on in ``text``; the arguments written whole so far."""
        i, n = self._at, len(text)
        while i < n and self.end is None:
            c = text[i]
            if self._quote:
                if c == "\\":
                    if i + 1 >= n:
                        break  # what it escapes is not written yet
                    i += 2
                    continue
                if text.startswith(self._quote, i):
                    i += len(self._quote)
                    self._quote = ""
                    continue
                if len(self._quote) == 3 and self._quote.startswith(text[i:]):
                    break  # perhaps the closing quotes being written
                i += 1
                continue
            if c in "'\"":
                if text.startswith(c * 3, i):
                    self._quote = c * 3
                elif (c * 3).startswith(text[i:]):
                    break  # one or two quotes so far: a triple's start, or not
                else:
                    self._quote = c
                i += len(self._quote)
                continue
            if c in "([{":
                self._depth += 1
            elif c in ")]}":
                if self._depth == 0:
                    if c == ")":
                        self._argument(text[self._segment : i])
                        self.end = i + 1
                    else:
                        self.failed = True
                        self.end = i + 1
                    break
                self._depth -= 1
            elif c == "," and self._depth == 0:
                self._argument(text[self._segment : i])
                self._segment = i + 1
            i += 1
        self._at = i
        return Pairs(list(self.pairs))

    def _argument(self, source: str) -> None:
        """One argument's text, ended by a comma or the ``)``."""
        if self.failed or not source.strip():  # f() or a trailing comma
            return
        try:
            tree = ast.parse(f"f({source.strip()})", mode="eval")
            _, args = call_of(tree.body)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            self.failed = True
            return
        self.pairs.extend(args.items())


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i
