"""``strict`` functions under ``tool_choice`` ``auto`` for the ``pythonic`` format (and
``llama4_pythonic``): a text that begins with ``[`` (or ``<|python_start|>``) is a
Python list of calls, ``[f(a=1), g(b="x")]``, held to the functions; one that begins
otherwise is free (as :func:`.strict_calls._leading` holds ``llama3_json``'s). Its calls'
rules (:func:`call_rules`) hold ``olmo3``'s too, a call a line in a block
(:func:`.strict_calls._olmo3`).

A call names one of the functions whose name is a Python (dotted) name. A strict
function's keyword arguments are its properties, each at most once and in the schema's
order (as llguidance writes a JSON object's keys), the ``required`` ones always; a
boolean's value is ``True`` or ``False``, a null's ``None``, another's JSON its schema
allows (a Python literal too, which :func:`.python_calls.literal` reads, ``true`` as
well). Another function's arguments are any keywords with JSON or Python constants.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Final

from .python_calls import END, START

_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_KEY: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WS: Final = {"whitespace_pattern": "[ ]?"}
"""Whitespace in a JSON value: none or one space (see :data:`.strict_calls._WS`)."""
_SEP: Final = '"," " "?'


def grammar(
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str | None:
    """The grammar for a text that is free or a list of calls of ``functions`` (each a
    name, its parameters' JSON Schema, and whether it is strict); ``parallel`` false:
    one call at most; ``token``: how the grammar names a special token (None: text).
    None: no function can be written as a Python call."""
    rules = call_rules(functions)
    if rules is None:
        return None
    start, end = token(START), token(END)
    mark, first = (start, r"\[") if start is not None else (json.dumps(START), r"\[<")
    close = end if end is not None else json.dumps(END)
    more = f" ({_SEP} pycall)*" if parallel else ""
    return "\n".join([
        "%llguidance {}",
        "start: TEXT | calls",
        rf"TEXT: /\s*([^\s{first}](.|\n)*)?/",
        f'calls: WS? ({mark} WS?)? "[" pycall{more} "]" WS? ({close} WS?)?',
        r"WS: /[ \t\r\n]+/",
        *rules,
    ])  # fmt: skip


def call_rules(functions: Sequence[tuple[str, dict[str, Any] | None, bool]]) -> list[str] | None:
    """The rules of ``pycall``, one Python call of one of ``functions`` (None: none can be
    written so)."""
    rules: list[str] = []
    entries: list[str] = []
    for k, (name, params, strict) in enumerate(functions):
        if _NAME.fullmatch(name) is None:
            continue  # a call Python cannot write
        args = _args(k, params, rules) if strict else "(kw (" + _SEP + " kw)*)?"
        if args is None:
            continue
        entries.append(f"fn_{k}")
        rules.append(f'fn_{k}: {json.dumps(name + "(")} {args} ")"')
    if not entries:
        return None
    return [
        "pycall: " + " | ".join(entries),
        r"kw: /[A-Za-z_][A-Za-z0-9_]{0,63}/ " + '"=" any',
        f'any: %json {json.dumps({"x-guidance": _WS})} | "True" | "False" | "None"',
        *rules,
    ]


def _args(k: int, params: dict[str, Any] | None, rules: list[str]) -> str | None:
    """Function ``k``'s keyword arguments as its ``params`` allow, its rules added to
    ``rules`` (None: a required property is not a Python name)."""
    props = (params or {}).get("properties")
    props = props if isinstance(props, dict) else {}
    needed = (params or {}).get("required")
    needed = set(needed) if isinstance(needed, list) else set()
    names = [key for key in props if _KEY.fullmatch(key)]
    if needed - set(names):
        return None  # (before any rule is added)
    items = []
    for j, key in enumerate(names):
        rules.append(f"arg_{k}_{j}: {json.dumps(key + '=')} {_value(props[key])}")
        items.append((f"arg_{k}_{j}", key in needed))
    return _sequence(items)


def _sequence(items: list[tuple[str, bool]]) -> str:
    """Comma-separated ``items`` (each a rule and whether it is required) in their order,
    each at most once: the alternatives for which is written first."""
    options = []
    for i, (rule, required) in enumerate(items):
        rest = " ".join(f"{_SEP} {r}" if req else f"({_SEP} {r})?" for r, req in items[i + 1 :])
        options.append(f"{rule} {rest}".rstrip())
        if required:
            return "(" + " | ".join(options) + ")"
    return "(" + " | ".join(options) + ")?" if options else ""


def _value(schema: Any) -> str:
    """A keyword argument's value, as its ``schema`` allows."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean" and "enum" not in schema and "const" not in schema:
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    sub = schema if isinstance(schema, dict) else {}
    return f"%json {json.dumps({**sub, 'x-guidance': _WS})}"
