"""HY-V4's tool calls (vLLM's ``hy_v4`` tool parser): GLM-4.5's blocks
``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`` in a
``<tool_calls>`` … ``</tool_calls>`` section, every tag ending in the suffix its
checkpoint's vocabulary tells (``<tool_call:6124c78e>``, as its reasoning tags do:
:data:`.reasoning.SUFFIXES`); each value typed by its schema as ``hy_v3``'s are
(a value as written where the schema says a string or nothing). As vLLM's (strict), the
calls are the blocks of the first section, once it closes, and only where every block
there is sound (a name, then whole key and value pairs; as many ends as openings): else
none, and the text is all content; with calls, the content is the text before the
section.

The suffix is known only at load, so the tags are too: :func:`register` gives a
checkpoint's calls their own parser name (``hy_v4`` and the suffix, e.g.
``hy_v4:6124c78e``) in the tables the readers look a parser up in (:mod:`.tool_formats`,
:mod:`.tool_blocks`, :mod:`.tool_chunks`, :mod:`.tagged_args`), which then read and stream
them as any other parser's. ``hy_v4`` itself is the unsuffixed tags'. Strict functions under ``auto`` are held as
``hy_v3``'s are (:mod:`.strict_calls`), in the suffixed tags.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from . import strict_calls, tagged_args, tool_blocks, tool_chunks, tool_formats
from .json_compact import Pairs
from .reasoning import suffix_of

PARSER: Final = "hy_v4"
_NAMES: Final = ("tool_calls", "tool_call", "arg_key", "arg_value")


def tags(suffix: str) -> tuple[str, ...]:
    """The tags with ``suffix``: the section's, a call's, a key's and a value's (each
    opening, closing)."""
    return tuple(f"<{end}{n}{suffix}>" for n in _NAMES for end in ("", "/"))


def parser_for(vocab: Iterable[str]) -> str:
    """The parser name for a tokenizer whose tokens are ``vocab`` (its suffix's,
    registered); a vocabulary without the section's tags is refused (as vLLM's)."""
    tokens = list(vocab)
    suffix = suffix_of(PARSER, tokens)
    section = tags(suffix)[:2]
    if not set(section) <= set(tokens):
        raise ValueError(f"tool_call_parser {PARSER!r}: the tokenizer has no {section[0]} and "
                         f"{section[1]} tokens")  # fmt: skip
    return register(suffix)


def register(suffix: str) -> str:
    """The parser name of the calls whose tags end in ``suffix``, its tables filled (once)."""
    name = PARSER + suffix
    if name in tool_formats.MARKERS:
        return name
    k_open, k_close, v_open, v_close = map(re.escape, tags(suffix)[4:])
    pair = re.compile(f"{k_open}(.*?){k_close}{v_open}(.*?){v_close}", re.DOTALL)

    def args(text: str, at: int, known: dict[str, str]) -> Pairs:
        return Pairs([(k, tagged_args.hy_v3_value(v, known.get(k)))
                      for k, v in pair.findall(text, at)])  # fmt: skip

    tagged_args.TYPED_ARGS[name] = args
    section_open, section_close, call_open, call_close, *_ = tags(suffix)
    tool_formats.MARKERS[name] = tags(suffix)
    tool_formats.SECTIONS[name] = (section_open, section_close)
    header = re.compile(rf"\s*([^<\s][^<\n]{{0,63}}?)\s*(?={k_open}|$)")
    tool_blocks.BLOCKS[name] = (call_open, call_close, tool_blocks.typed_body(header, name))

    def sound(block: str) -> bool:
        """Whether a block is written as vLLM's strict reading wants: a name, then only
        whole key and value pairs."""
        at = block.find(tags(suffix)[4])
        rest = block[at:].strip() if at >= 0 else ""
        k_tags, v_tags = tags(suffix)[4:6], tags(suffix)[6:]
        return (bool((block[:at] if at >= 0 else block).strip())
                and rest.count(k_tags[0]) == rest.count(k_tags[1])
                and rest.count(v_tags[0]) == rest.count(v_tags[1])
                and not pair.sub("", rest).strip())  # fmt: skip

    tool_blocks.SECTIONED[name] = sound
    strict_calls.TYPED[name] = strict_calls.Tagged(
        section_open, section_close, True, call_open + "{}", call_close,
        f"<arg_key{suffix}>{{}}</arg_key{suffix}><arg_value{suffix}>", f"</arg_value{suffix}>",
        "[^<\\n]{1,128}",
    )  # fmt: skip
    tool_chunks._AFTER_MARKER[name] = re.compile(rf"\s*([^<\s][^<\n]{{0,63}}?)\s*(?={k_open})")
    return name


register("")
