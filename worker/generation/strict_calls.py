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
JSON blocks, or JSON arrays of them after a marker, are built (:data:`BLOCKS`); for the
others ``strict`` is not enforced.
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
    markers = BLOCKS.get(parser)
    if markers is None or not functions:
        return None
    opening, closing, listed = markers
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": params if strict and params else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params, strict in functions
    ]
    body: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if listed:
        most = {} if parallel else {"maxItems": 1}
        body = {"type": "array", "minItems": 1, **most, "items": body}
    body["x-guidance"] = {"whitespace_pattern": _SPACE}
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


_SPACE: Final = "[ ]?"
"""Whitespace between a call's JSON tokens: none or one space, as models write calls on
one line (``{"name": "f", "arguments": {"a": 1}}``); a random or drifting model is not
left to write whitespace forever."""


def _without(marker: str) -> str:
    """A terminal for any text that does not write ``marker``."""
    escaped = re.escape(marker).replace("/", "\\/")
    return f"/(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/"
