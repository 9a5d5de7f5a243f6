"""``tool_choice`` ``auto`` with ``strict`` functions (OpenAI's ``strict: true``; vLLM's
structural tags): the text stays free, but once the model writes a call's opening marker,
the call follows the model's format and its function's schema, to the closing marker.

The constraint is a Lark grammar (llguidance's, as its ``StructTag`` builds them): free
text, and calls, each free text ended by the opening marker, then a JSON object
``{"name": ..., "arguments": ...}`` that is one of the functions' (a ``strict``
function's arguments follow its ``parameters``; another's are any object), then the
closing marker. Where the tokenizer makes a marker a special token, the grammar names the
token (free text cannot write it); else the marker is text, and the free text before it
is a lazy lexeme that ends where the marker is written. The formats whose calls are such
JSON blocks, or JSON arrays of them after a marker, are built (:data:`BLOCKS`), and
those whose calls are the whole text (:data:`LEADING`: a text that begins with ``{`` or
the marker is held to calls, one that begins otherwise is free); for the others
``strict`` is not enforced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Final

BLOCKS: Final[dict[str, tuple[str, str, bool]]] = {
    "hermes": ("<tool_call>", "</tool_call>", False),
    "longcat": ("<longcat_tool_call>", "</longcat_tool_call>", False),
    "granite": ("<|tool_call|>", "", True),
    "hunyuan_a13b": ("<tool_calls>", "</tool_calls>", True),
}
"""The parsers whose calls a grammar can hold: their opening and closing markers (""
none), and whether a block holds a JSON array of calls (else one call)."""
LEADING: Final[dict[str, str]] = {"llama3_json": "<|python_tag|>"}
"""The parsers whose calls are the whole text, after an optional marker: JSON objects
``{"name", "parameters"}`` separated by ``;`` (a text that begins otherwise is free)."""


def grammar(
    parser: str,
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    special: Callable[[str], bool],
) -> str | None:
    """The grammar for a text with calls of ``functions`` (each a name, its parameters'
    JSON Schema, and whether it is strict) in ``parser``'s format; ``parallel`` false:
    one call at most; ``special``: whether the tokenizer makes a marker a special token.
    None: the format is not built."""
    if not functions:
        return None
    if parser in LEADING:
        return _leading(LEADING[parser], _body(functions, "parameters"), parallel, special)
    markers = BLOCKS.get(parser)
    if markers is None:
        return None
    opening, closing, listed = markers
    body = _body(functions, "arguments")
    if listed:
        most = {} if parallel else {"maxItems": 1}
        item = {k: v for k, v in body.items() if k != "x-guidance"}
        body = {"type": "array", "minItems": 1, **most, "items": item, "x-guidance": _WS}
    if special(opening):
        head, text = f"call_head: TEXT {opening}", r"/(.|\n)*/"
    else:  # the text after the one call may not write another's marker
        head = f"call_head[lazy]: TEXT {json.dumps(opening)}"
        text = r"/(.|\n)*/" if parallel else _without(opening)
    close = "" if not closing else closing if special(closing) else json.dumps(closing)
    return "\n".join([
        "%llguidance {}",
        "start: call* TEXT" if parallel else "start: TEXT | call TAIL",
        r"TEXT: /(.|\n)*/",
        f"TAIL: {text}",
        head,
        f"call: call_head WS? body WS? {close}" if close else "call: call_head WS? body",
        r"WS: /[ \t\r\n]+/",
        f"body: %json {json.dumps(body)}",
    ])  # fmt: skip


_WS: Final = {"whitespace_pattern": "[ ]?"}
"""Whitespace between a call's JSON tokens: none or one space, as models write calls on
one line (``{"name": "f", "arguments": {"a": 1}}``); a random or drifting model is not
left to write whitespace forever."""


def _body(functions: Sequence[tuple[str, dict[str, Any] | None, bool]], key: str) -> dict[str, Any]:
    """One call's JSON Schema: ``{"name": ..., key: ...}`` of one of ``functions``."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                key: params if strict and params else {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for name, params, strict in functions
    ]
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _WS}


def _leading(marker: str, body: dict[str, Any], parallel: bool,
             special: Callable[[str], bool]) -> str:  # fmt: skip
    """A text that is calls (after ``marker``, or from its first ``{``), or free text
    that begins otherwise."""
    mark, first = (marker, "{") if special(marker) else (json.dumps(marker), "{<")
    more = ' (WS? ";" WS? body)*' if parallel else ""
    return "\n".join([
        "%llguidance {}",
        "start: TEXT | calls",
        rf"TEXT: /\s*([^\s{first}](.|\n)*)?/",
        f"calls: WS? ({mark} WS?)? body{more} WS?",
        r"WS: /[ \t\r\n]+/",
        f"body: %json {json.dumps(body)}",
    ])  # fmt: skip


def _without(marker: str) -> str:
    """A terminal for any text that does not write ``marker``."""
    escaped = re.escape(marker).replace("/", "\\/")
    return f"/(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/"
