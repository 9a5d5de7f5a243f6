"""vLLM's structural tags (``structured_outputs.structural_tag``, ``response_format``
``structural_tag``) as a Lark grammar for llguidance, as vLLM's ``guidance`` backend
builds them (``llguidance.StructTag``): free text, where each trigger written begins one
of the structures that begin with it (the rest of its ``begin``, JSON valid under its
schema, its ``end``), then free text again.

Unlike ``StructTag.to_grammar``, which takes every ``<...>`` trigger for a special token,
a trigger is named as a special token only where this tokenizer makes it one
(``Grammars.token``): free text cannot write it. Else it is text, and the free text
before it is a lazy lexeme that ends where it is written. The special tokens in a
structure's ``begin`` and ``end`` are named too (``}</tool_call>``: ``"}"`` then the
token).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from ...schemas.messages import StructuralTag


def grammar(tag: StructuralTag, token: Callable[[str], str | None]) -> str:
    """The grammar of a text that ``tag`` holds; ``token``: how the grammar names a
    special token (None: the text is not one)."""
    rules: list[str] = []
    for i, s in enumerate(tag.structures):
        trigger = next(t for t in tag.triggers if s.begin.startswith(t))  # (validated)
        rest = s.begin[len(trigger) :]
        parts = [_text(rest, token), f"%json {json.dumps(s.json_schema)}", _text(s.end, token)]
        body = " ".join(p for p in parts if p)
        ref = token(trigger)
        if ref is not None:
            rules.append(f"tag_{i}: TEXT {ref} {body}")
        else:
            rules += [f"tag_{i}_trigger[lazy]: TEXT {json.dumps(trigger)}",
                      f"tag_{i}: tag_{i}_trigger {body}"]  # fmt: skip
    return "\n".join([
        "%llguidance {}",
        "start: (" + " | ".join(f"tag_{i}" for i in range(len(tag.structures))) + ")* TEXT",
        r"TEXT: /(.|\n)*/",
        *rules,
    ])  # fmt: skip


_MARKER = re.compile(r"(<[^<>\s]{1,64}>|\[[A-Za-z_/]{1,64}\])")
"""What may be a special token in a structure's text (``<...>``, ``[NAME]``)."""


def _text(text: str, token: Callable[[str], str | None]) -> str:
    """``text`` in the grammar: its special tokens named, the rest as characters ("":
    none)."""
    parts: list[str] = []
    chars = ""
    for piece in _MARKER.split(text):
        ref = token(piece) if _MARKER.fullmatch(piece) else None
        if ref is None:
            chars += piece
            continue
        if chars:
            parts.append(json.dumps(chars))
        parts.append(ref)
        chars = ""
    if chars:
        parts.append(json.dumps(chars))
    return " ".join(parts)
