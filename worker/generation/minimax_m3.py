"""MiniMax-M3's tool calls (vLLM's ``minimax_m3`` parser, its Rust grammar's Python twin
``M3TextParser``): XML tags each led by the namespace token ``]<]minimax[>[`` (:data:`NS`).

One ``NS<tool_call>`` ... ``NS</tool_call>`` section holds the calls, each
``NS<invoke name="NAME">`` + its parameters + ``NS</invoke>``; a parameter is a tag named
after it, ``NS<KEY>VALUE NS</KEY>``. A value that is text is typed by the function's
schema (as ``qwen3_coder``'s, :mod:`.tagged_args`); one that is tags is an object of them
(a tag written twice: a list of its values; text beside tags: a ``$text`` member), or,
where the schema says ``array`` and the first tag is ``<item>``, a list of the items.
Nested values are text (vLLM's types them by the nested schemas, which the request's
``Types`` do not hold).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from .json_compact import Pairs

Typed = Callable[[str, "str | None"], Any]
"""How a text value is typed by its schema's kind (:mod:`.tagged_args`'s)."""

NS: Final = "]<]minimax[>["
"""The namespace token that leads each of the format's tags."""
SECTION: Final = (NS + "<tool_call>", NS + "</tool_call>")
INVOKE: Final = (NS + "<invoke name=", NS + "</invoke>")
"""A call's markers (its name, quoted, and ``>`` follow the first)."""
HEADER: Final = re.compile(r'"([^"\n]{1,64})">')
"""A call's name, after its opening marker (group 1)."""
_OPEN: Final = re.compile(r"\s*" + re.escape(NS) + r"<([^/>\s][^>\s]{0,127})>")


def args(text: str, at: int, known: dict[str, str], typed: Typed) -> Pairs:
    """The parameters written whole in ``text`` from ``at`` (up to the first not closed
    yet), their text typed by ``known`` with ``typed``."""
    out: list[tuple[str, Any]] = []
    while (m := _OPEN.match(text, at)) is not None:
        key = m.group(1)
        end = text.find(f"{NS}</{key}>", m.end())
        if end < 0:
            break
        body, kind = text[m.end() : end], known.get(key)
        out.append((key, typed(body, kind) if not body.startswith(NS + "<") else _tags(body, kind)))
        at = end + len(NS) + len(key) + 3
    return Pairs(out)


def _tags(body: str, kind: str | None) -> Any:
    """A parameter's value written as tags (vLLM's ``_parse_parameter``): a list where
    ``kind`` says ``array`` and the first is ``<item>``, else an object."""
    chunks = body.split(NS)
    listed = kind == "array" and chunks[1].startswith("<item>")
    stack = [_Item(None, [] if listed else {})]
    for chunk in chunks[1:]:
        closing = chunk.startswith("</")
        tag, gt, rest = chunk[2 if closing else 1 :].partition(">")
        if closing:
            while len(stack) > 1:
                item = stack.pop()
                stack[-1].add(item)
                if item.tag == tag:
                    break
            if gt and rest:
                stack[-1].text(rest)
        elif chunk.startswith("<"):
            stack.append(_Item(tag, None, [rest] if gt and rest else []))
        elif chunk:
            stack[-1].text(chunk)
    while len(stack) > 1:
        item = stack.pop()
        stack[-1].add(item)
    return stack[0].value_of()


@dataclass(slots=True)
class _Item:
    """A tag being read: its value (None: text so far, no tags in it), its texts."""

    tag: str | None
    value: dict[str, Any] | list[Any] | None
    texts: list[str] = field(default_factory=list)

    def value_of(self) -> Any:
        if self.value is None:
            return "".join(self.texts)
        if self.texts and isinstance(self.value, dict):
            key = "$text"
            while key in self.value:
                key = "$" + key
            self.value[key] = "".join(self.texts)
        return self.value

    def add(self, item: _Item) -> None:
        got = item.value_of()
        if self.value is None:
            self.value = {}
        if isinstance(self.value, list):
            self.value.append(got)
        elif item.tag in self.value:
            had = self.value[item.tag or ""]
            self.value[item.tag or ""] = [*had, got] if isinstance(had, list) else [had, got]
        else:
            self.value[item.tag or ""] = got

    def text(self, value: str) -> None:
        if isinstance(self.value, list):
            self.value.append(value)
        else:
            self.texts.append(value)
