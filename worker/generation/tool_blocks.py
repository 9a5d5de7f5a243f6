"""The tool-call formats whose calls are blocks between markers (``hermes``, ``qwen3_coder``,
``glm45``, DeepSeek's, Kimi's...): how each block's text reads (its body), and the scan
that reads them, settled after the last closed block so a growing text is not read again
from its start. (:mod:`.blocks` is another thing: message blocks of reasoning, text and
calls.)"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

from . import gemma4_args, minimax_m3, xtml
from .minicpm5_aliases import rename
from .tagged_args import TYPED_ARGS, Types, minicpm5_args, minicpm5_sound, required
from .tool_formats import DS, GEMMA, GEMMA4, KIMI, SECTIONS, SOLAR, STEP, V32
from .tool_found import Found, Resume, Scan, decode, entry, parse_json, skip

Body = Callable[[str, Types], "tuple[str, dict[str, Any], str | None] | None"]
"""A block's call read from its text between the markers (name, arguments, the model's
id), given the functions' types; None: not a call."""


def scan_blocks(opening: str, closing: str, body: Body, types: Types, cut: bool = True) -> Resume:
    """Calls in blocks, each from an ``opening`` marker to the next ``closing`` one (a
    block cut by the end read too, where the text is whole, unless not ``cut``); settled
    after the last closed block (the blocks are read apart)."""

    def scan(text: str, final: bool, start: int) -> tuple[list[Found], int]:
        out: list[Found] = []
        i = text.find(opening, start)
        while i >= 0:
            j = text.find(closing, i + len(opening))
            if j < 0 and not (final and cut):
                break
            end = len(text) if j < 0 else j + len(closing)
            got = body(text[i + len(opening) : len(text) if j < 0 else j], types)
            if got is not None:
                out.append(Found(i, end, *got))
            if j < 0:
                break
            start = end
            i = text.find(opening, start)
        return out, start

    return scan


def sectioned(parser: str, types: Types) -> Scan:
    """A :data:`SECTIONED` parser's calls: the blocks of its first closed section, where
    each is a sound call and nothing else is between its markers (else none)."""
    opening, closing, body = BLOCKS[parser]
    begin, close = SECTIONS[parser]
    sound = SECTIONED[parser]

    def scan(text: str, final: bool) -> list[Found]:
        at = text.find(begin)
        end = text.find(close, at + len(begin)) if at >= 0 else -1
        inner = text[at + len(begin) : end]
        if end < 0 or inner.count(opening) != inner.count(closing):
            return []
        found = scan_blocks(opening, closing, body, types, cut=False)(inner, True, 0)[0]
        blocks = [inner[f.start + len(opening) : f.end - len(closing)] for f in found]
        if not found or len(found) != inner.count(opening) or not all(map(sound, blocks)):
            return []
        shift = at + len(begin)
        out = [Found(f.start + shift, f.end + shift, f.name, f.args, f.id) for f in found]
        out[-1] = Found(out[-1].start, len(text), out[-1].name, out[-1].args, out[-1].id)
        return out

    return scan


def with_dots_json(blocks: Resume, types: Types) -> Resume:
    """``dots``'s blocks, and its sections that are a JSON call each (vLLM's fallback),
    in the text's order."""

    def resume(text: str, final: bool, start: int) -> tuple[list[Found], int]:
        found = blocks(text, final, 0)[0] + _dots_json(text, final, types)
        return sorted(found, key=lambda f: f.start), 0

    return resume


def _dots_json(text: str, final: bool, types: Types) -> list[Found]:
    """The ``dots`` sections that are one JSON object ``{"name", "arguments" (or
    "parameters")}`` of a function the request has, once the section closes (or the
    text, whole, ends)."""
    begin, close = SECTIONS["dots"]
    out: list[Found] = []
    at = text.find(begin)
    while at >= 0:
        i = skip(text, at + len(begin))
        got = decode(text, i) if text.startswith("{", i) else None
        if got is not None and isinstance(got[0], dict):
            after = skip(text, got[1])
            name = got[0].get("name")
            args = got[0].get("arguments", got[0].get("parameters", {})) or {}
            if ((text.startswith(close, after) or (final and after == len(text)))
                    and isinstance(name, str) and name in types and isinstance(args, dict)):  # fmt: skip
                out.append(Found(at, got[1], name, args))
        at = text.find(begin, at + len(begin))
    return out


def _hermes_body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
    found = entry(parse_json(text), 0, 0)
    return None if found is None else (found.name, found.args, None)


_FUNCTION = re.compile(r"\s*<function=([^>\n]{1,64})>(.*?)</function>", re.DOTALL)


def typed_body(header: re.Pattern[str], parser: str) -> Body:
    """A typed format's block: a header naming the function (group 1), then its
    parameters (group 2 where the header has one, else what follows it); a call of a
    function not among the request's is none where the parser says so (:data:`KNOWN_ONLY`)."""
    args = TYPED_ARGS[parser]
    known = parser in KNOWN_ONLY

    def body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
        m = header.match(text)
        if m is None or (known and m.group(1).strip() not in types):
            return None
        name = m.group(1).strip()
        inner, at = (m.group(2), 0) if header.groups >= 2 else (text, m.end())
        return name, args(inner, at, types.get(name, {})), None

    return body


_GLM_NAME = re.compile(r"\s*([^<\s][^<\n]{0,63}?)\s*(?=<arg_key>|$)")


_INVOKE = re.compile(r'\s*name="([^"\n]{1,64})"\s*>')
DOTS_INVOKE = re.compile(r"""\s+name\s*=\s*["']?([^"'>\n]{1,64}?)["']?\s*>""")
V32_INVOKE = re.compile(r'\s+name="([^"\n]{1,64})"\s*>')


_DS_V3 = re.compile(r"\s*\w*\s*" + re.escape(DS[4]) +
                    r"\s*([^\n]{1,64}?)\s*\n```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)  # fmt: skip
_DS_V31 = re.compile(r"\s*([^\n<]{1,64}?)\s*" + re.escape(DS[4]) + r"(.*)$", re.DOTALL)


def _deepseek_body(pattern: re.Pattern[str]) -> Body:
    def body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
        m = pattern.match(text)
        args = None if m is None else parse_json(m.group(2))
        if m is None or not isinstance(args, dict):
            return None
        return m.group(1), args, None

    return body


STEP3_INVOKE = re.compile(r"\s*function\s*" + re.escape(STEP[4]) +
                           r'\s*<steptml:invoke name="([^"\n]{1,64})">')  # fmt: skip
_KIMI_CALL = re.compile(r"\s*((?:functions\.)?([^\s:<]{1,64}):\d{1,6})\s*"
                        r"<\|tool_call_argument_begin\|>(.*)$", re.DOTALL)  # fmt: skip


def _kimi_k2_body(text: str, types: Types) -> tuple[str, dict[str, Any], str] | None:
    m = _KIMI_CALL.match(text)
    args = None if m is None else parse_json(m.group(3))
    if m is None or not isinstance(args, dict):
        return None
    return m.group(2), args, m.group(1)


HY_NAME = re.compile(r"\s*([^<\n]{1,64}?)\s*<tool_sep>")
SOLAR_NAME = re.compile(r"\s*([^\s<][^<\n]{0,63}?)[^\S\n]*\n")
"""Solar Open 2's call header: the name, a line of its own (the rest of the start
marker's, as the model writes it)."""

GEMMA_CALL = re.compile(r"\s*call:(\w+)\{")
"""FunctionGemma's call header: ``call:NAME{`` (vLLM's: a name of word characters)."""

_GEMMA4_CALL = re.compile(r"call:([\w\-.]+)\{(.*)\}\Z", re.DOTALL)
"""A Gemma 4 call: ``call:NAME{ARGUMENTS}``, the block's whole text (vLLM's)."""


def _gemma4_body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
    m = _GEMMA4_CALL.match(text)
    return None if m is None else (m.group(1), gemma4_args.read(m.group(2)), None)


MINICPM5_NAME = re.compile(r"""\s*name=['"]([^'"\n]{1,64})['"][^>]*>""")
"""A MiniCPM5 call's header, after ``<function``: its name."""


def _minicpm5_body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
    """A MiniCPM5 block's call, sound as vLLM's reads it, of one of the request's
    functions, or of a name it renames to one (:mod:`.minicpm5_aliases`: its parameters
    read untyped, the renamed call's ``required`` given)."""
    m = MINICPM5_NAME.match(text)
    name = "" if m is None else m.group(1).strip()
    known = types.get(name, {})
    if m is None or not name or not minicpm5_sound(text, m.end(), known):
        return None
    args = minicpm5_args(text, m.end(), known)
    if name in types:
        return name, args, None
    name, renamed = rename(name, args, types)
    if name not in types or not required(types[name]) <= renamed.keys():
        return None
    return name, renamed, None


KNOWN_ONLY: Final = frozenset({"dots", "minicpm5"})
"""The parsers for which a call of a function the request does not have is none (vLLM's
``dots`` and ``minicpm5``, but for the names ``minicpm5`` renames to one it has: those
calls come whole once their block closes)."""
BLOCKS: Final[dict[str, tuple[str, str, Body]]] = {
    "hermes": ("<tool_call>", "</tool_call>", _hermes_body),
    "qwen3_coder": ("<tool_call>", "</tool_call>", typed_body(_FUNCTION, "qwen3_coder")),
    "glm45": ("<tool_call>", "</tool_call>", typed_body(_GLM_NAME, "glm45")),
    "deepseek_v3": (DS[2], DS[3], _deepseek_body(_DS_V3)),
    "deepseek_v31": (DS[2], DS[3], _deepseek_body(_DS_V31)),
    "kimi_k2": (KIMI[2], KIMI[3], _kimi_k2_body),
    "seed_oss": ("<seed:tool_call>", "</seed:tool_call>", typed_body(_FUNCTION, "seed_oss")),
    "minimax_m2": ("<invoke", "</invoke>", typed_body(_INVOKE, "minimax_m2")),
    "internlm": ("<|action_start|><|plugin|>", "<|action_end|>", _hermes_body),
    "longcat": ("<longcat_tool_call>", "</longcat_tool_call>", _hermes_body),
    "step3": (STEP[2], STEP[3], typed_body(STEP3_INVOKE, "step3")),
    "deepseek_v32": (V32[2], V32[3], typed_body(V32_INVOKE, "deepseek_v32")),
    "mimo": ("<tool_call>", "</tool_call>", typed_body(_FUNCTION, "mimo")),
    "hy_v3": ("<tool_call>", "</tool_call>", typed_body(HY_NAME, "hy_v3")),
    "solar_open2": (SOLAR[0], SOLAR[1], typed_body(SOLAR_NAME, "solar_open2")),
    "dots": ("<invoke", "</invoke>", typed_body(DOTS_INVOKE, "dots")),
    "deepseek_v4": (V32[2], V32[3], typed_body(V32_INVOKE, "deepseek_v4")),
    "functiongemma": (GEMMA[0], GEMMA[1], typed_body(GEMMA_CALL, "functiongemma")),
    "gemma4": (GEMMA4[0], GEMMA4[1], _gemma4_body),
    "minicpm5": ("<function", "</function>", _minicpm5_body),
    "kimi_k3": (*xtml.CALL, xtml.body),
    "minimax_m3": (*minimax_m3.INVOKE, typed_body(minimax_m3.HEADER, "minimax_m3")),
}
"""The parsers whose calls are blocks: their markers and how a block's text reads."""
SECTIONED: Final[dict[str, Callable[[str], bool]]] = {}
"""The block parsers whose calls are their first section's blocks, once it closes, all or
none (vLLM's ``hy_v4``, strict): each with whether a block's text (between its markers) is
written soundly; the text after the section is the calls' too (the content is what
precedes it)."""
