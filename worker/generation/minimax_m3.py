"""MiniMax-M3's tool calls (vLLM's ``minimax_m3`` parser, its Rust grammar's Python twin
``M3TextParser``): XML tags each led by the namespace token ``]<]minimax[>[`` (:data:`NS`).

One ``NS<tool_call>`` ... ``NS</tool_call>`` section holds the calls, each
``NS<invoke name="NAME">`` + its parameters + ``NS</invoke>``; a parameter is a tag named
after it, ``NS<KEY>VALUE NS</KEY>``. A value that is text is read by its parameter's
schema (:mod:`.data_types`: the reading the whole schema allows, by ``jsonschema``; no
schema: the text as written); one that is tags is an object of them (a tag written
twice: a list of its values; text beside tags: a ``$text`` member), or, where the schema
allows an array and the first tag is ``<item>``, a list of the items; each nested value
read by its own schema (a property's, an item's), as vLLM's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final

from .data_types import DataType
from .json_compact import Pairs

NS: Final = "]<]minimax[>["
"""The namespace token that leads each of the format's tags."""
SECTION: Final = (NS + "<tool_call>", NS + "</tool_call>")
INVOKE: Final = (NS + "<invoke name=", NS + "</invoke>")
"""A call's markers (its name, quoted, and ``>`` follow the first)."""
HEADER: Final = re.compile(r'"([^"\n]{1,64})">')
"""A call's name, after its opening marker (group 1)."""
_OPEN: Final = re.compile(r"\s*" + re.escape(NS) + r"<([^/>\s][^>\s]{0,127})>")


def args(text: str, at: int, known: dict[str, str],
         schemas: dict[str, Any] | None = None) -> Pairs:  # fmt: skip
    """The parameters written whole in ``text`` from ``at`` (up to the first not closed
    yet), each read by its JSON Schema in ``schemas``, else by its ``known`` type (neither:
    a text as written, tags untyped)."""
    out: list[tuple[str, Any]] = []
    while (m := _OPEN.match(text, at)) is not None:
        key = m.group(1)
        end = text.find(f"{NS}</{key}>", m.end())
        if end < 0:
            break
        body = text[m.end() : end]
        schema = (schemas or {}).get(key) or ({"type": known[key]} if key in known else None)
        kind = DataType.of(schema)
        out.append((key, _tags(body, kind) if body.startswith(NS + "<") else kind.convert(body)))
        at = end + len(NS) + len(key) + 3
    return Pairs(out)


def _tags(body: str, kind: DataType) -> Any:
    """A parameter's value written as tags (vLLM's ``_parse_parameter``): a list where its
    schema allows an array and the first tag is ``<item>``, else an object; each tag's
    value typed by its schema (an object's property's, an array's item's)."""
    chunks = body.split(NS)
    listed = "array" in kind.kinds and chunks[1].startswith("<item>")
    stack = [_Item(None, [] if listed else {}, kind)]
    for i, chunk in enumerate(chunks[1:], 1):
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
            sub = stack[-1].member(tag)
            nxt = chunks[i + 1] if i + 1 < len(chunks) else ""
            value: dict[str, Any] | list[Any] | None = None
            if sub is not None and "array" in sub.kinds and nxt.startswith("<item>"):
                value = []
            elif sub is not None and "object" in sub.kinds:
                value = {}
            stack.append(_Item(tag, value, sub, [rest] if gt and rest else []))
        elif chunk:
            stack[-1].text(chunk)
    while len(stack) > 1:
        item = stack.pop()
        stack[-1].add(item)
    return stack[0].value_of()


@dataclass(slots=True)
class _Item:
    """A tag being read: its value (None: text so far, no tags in it), its schema (None:
    none known), its texts."""

    tag: str | None
    value: dict[str, Any] | list[Any] | None
    kind: DataType | None
    texts: list[str] = field(default_factory=list)

    def value_of(self) -> Any:
        if self.value is None:
            text = "".join(self.texts)
            return text if self.kind is None else self.kind.convert(text)
        if self.texts and isinstance(self.value, dict):
            key = "$text"
            while key in self.value:
                key = "$" + key
            self.value[key] = "".join(self.texts)
        return self.value

    def member(self, tag: str) -> DataType | None:
        """The schema of a tag opened in this one: an item's, or a property's."""
        if self.kind is None:
            return None
        if isinstance(self.value, list):
            return self.kind.item(len(self.value))
        return self.kind.property(tag) if isinstance(self.value, dict) else None

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
            kind = None if self.kind is None else self.kind.item(len(self.value))
            self.value.append(value if kind is None else kind.convert(value))
        else:
            self.texts.append(value)
