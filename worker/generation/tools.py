"""Tool calls read out of a generated text (schemas/tools.py has the request side).

With ``tool_choice`` ``required`` or a named function the text was constrained to JSON
(vLLM's schemas), so it parses unless generation stopped early (``length``, a deadline).
With ``auto`` the text is free, and a parser for the model's own format (its
``tool_call_parser`` option; vLLM's names) finds the calls:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
  Qwen 2.5 and 3, and other templates that render ``tools``);
- ``llama3_json``: a text that is JSON objects ``{"name": ..., "parameters": {...}}``
  separated by ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 to 3.3);
- ``mistral``: after ``[TOOL_CALLS]``, a JSON array of ``{"name", "arguments"}`` or, in
  newer tokenizers, ``name[ARGS]{...}``;
- ``pythonic``: a text that is a Python list of calls, ``[f(a=1), g(b="x")]``, in an
  optional ``<|python_start|>`` ... ``<|python_end|>`` (Llama 3.2 and 4), read with
  :mod:`ast` (literals only: nothing is evaluated);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`` (Qwen3-Coder), each value raw text, typed by the function's
  schema (``Types``, :mod:`.tagged_args`): a string stays as written, a number, boolean, object or array is
  read as JSON (then as a Python literal), ``null`` is null;
- ``glm45``: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
  </tool_call>`` (GLM-4.5, 4.6), each value typed as ``qwen3_coder``'s, but read as JSON
  unless its schema says it is a string (vLLM's);
- ``deepseek_v3``: in ``<|tool calls begin|>`` ... ``<|tool calls end|>``, blocks
  ``<|tool call begin|>function<|tool sep|>NAME`` and the arguments in a fenced
  ```` ```json ```` block, then ``<|tool call end|>`` (DeepSeek-V3, R1-0528; its markers
  are written with U+FF5C for the bars and U+2581 for the spaces);
- ``deepseek_v31``: the same blocks as ``NAME<|tool sep|>ARGUMENTS`` (DeepSeek-V3.1);
- ``seed_oss``: ``qwen3_coder``'s blocks between ``<seed:tool_call>`` and
  ``</seed:tool_call>`` (Seed-OSS);
- ``minimax_m2``: in ``<minimax:tool_call>`` ... ``</minimax:tool_call>``, blocks
  ``<invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>`` (MiniMax-M2),
  each value typed as ``qwen3_coder``'s;
- ``internlm``: ``<|action_start|><|plugin|>{"name": ..., "parameters": {...}}
  <|action_end|>`` blocks (InternLM 2.5);
- ``granite``: after ``<|tool_call|>``, a JSON array of ``{"name", "arguments"}`` (IBM
  Granite 3);
- ``hunyuan_a13b``: in ``<tool_calls>`` ... ``</tool_calls>``, a JSON array of them
  (Hunyuan-A13B);
- ``minimax``: in ``<tool_calls>`` ... ``</tool_calls>``, JSON objects ``{"name",
  "arguments"}`` one after another (MiniMax-M1);
- ``phi4_mini_json``: after ``functools``, a JSON array of them (Phi-4-mini);
- ``xlam``: a JSON array of them: the whole text, or in a fenced ```` ```json ```` block,
  after ``[TOOL_CALLS]`` or in a ``<tool_call>`` block (Salesforce xLAM);
- ``longcat``: ``hermes``'s blocks as ``<longcat_tool_call>`` ... ``</longcat_tool_call>``
  (LongCat-Flash);
- ``step3``: in ``<|tool_calls_begin|>`` ... ``<|tool_calls_end|>``, blocks
  ``<|tool_call_begin|>function<|tool_sep|><steptml:invoke name="NAME">
  <steptml:parameter name="KEY">VALUE</steptml:parameter>...</steptml:invoke>
  <|tool_call_end|>`` (Step-3; its bars are U+FF5C), each value trimmed, typed as
  ``qwen3_coder``'s;
- ``olmo3``: in ``<function_calls>`` ... ``</function_calls>``, a Python call a line,
  read as ``pythonic``'s (OLMo 3; the first block);
- ``gigachat3``: a JSON call ``{"name", "arguments"}`` after ``function call<|role_sep|>``
  (GigaChat 3, after its ``<|message_sep|>``) or ``<|function_call|>`` (GigaChat 3.1);
- ``deepseek_v32``: in ``<|DSML|function_calls>`` ... ``</|DSML|function_calls>``, blocks
  ``<|DSML|invoke name="NAME"><|DSML|parameter name="KEY" string="true">VALUE
  </|DSML|parameter>...</|DSML|invoke>`` (DeepSeek-V3.2; its bars are U+FF5C), a
  ``string="true"`` value as written, another typed by the schema, JSON where untyped;
- ``mimo``: ``qwen3_coder``'s blocks, each value a string as written (MiMo; vLLM's);
- ``hy_v3``: in ``<tool_calls>`` ... ``</tool_calls>``, blocks ``<tool_call>NAME<tool_sep>
  <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`` (Hunyuan Hy3), each
  value typed by its schema as vLLM's ``hy_v3`` does;
- ``solar_open2``: blocks ``<|tool_call:start|>NAME`` and a newline, then
  ``<|tool_arg:start|>KEY<|tool_arg:value|>VALUE<|tool_arg:end|>``..., then
  ``<|tool_call:end|>`` (Solar Open 2), each value coerced by its schema as vLLM's;
- ``lfm2``: a ``pythonic`` list in the first ``<|tool_call_start|>`` ...
  ``<|tool_call_end|>`` (LiquidAI LFM2); the model's echo of it after the block, capped by
  another end marker, is the calls' markup too;
- ``apertus``: after ``<|tools_prefix|>``, a JSON array of ``{NAME: ARGUMENTS}`` objects,
  then ``<|tools_suffix|>`` (Swiss AI Apertus);
- ``dots``: in ``<dots_function_call>`` ... ``</dots_function_call>``, blocks ``<invoke
  name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>`` (dots.llm), each value
  trimmed, typed by its schema as vLLM's ``dots`` does, or (vLLM's fallback) a section that
  is one JSON call ``{"name", "arguments"}``; a call of a function the request does not
  have is none;
- ``deepseek_v4``: ``deepseek_v32``'s blocks in ``<|DSML|tool_calls>`` ...
  ``</|DSML|tool_calls>`` (DeepSeek-V4; its bars are U+FF5C);
- ``granite-20b-fc``: a JSON call ``{"name", "arguments"}`` after each
  ``<function_call>`` (IBM granite-20b-functioncalling);
- ``functiongemma``: ``<start_function_call>call:NAME{KEY:<escape>VALUE<escape>,...}
  <end_function_call>`` (FunctionGemma), each value JSON, else a string; a value not in
  ``<escape>`` is not read (vLLM's);
- ``gemma4``: ``<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>`` (Gemma 4), each value a
  ``<|"|>`` string, a nested object or array, or a bare literal (:mod:`.gemma4_args`);
- ``minicpm5``: blocks ``<function name="NAME"><param name="KEY">VALUE</param>...
  </function>`` (MiniCPM5; the parameters perhaps in an ``<arguments>`` element), each
  value typed as vLLM's ``minicpm5`` does (:mod:`.tagged_args`), a parameter the
  function's schema does not list left out (a ``properties``/``arguments`` wrapper read
  for those it lists); a call of a function the request does not have, with a parameter
  written twice or without its name, or without a ``required`` one, is none;
- vLLM's other names for these formats (:data:`ALIASES`): ``jamba`` (``hunyuan_a13b``'s,
  AI21 Jamba), ``llama4_json`` (``llama3_json``'s), ``llama4_pythonic`` (``pythonic``'s,
  Llama 4), ``ernie45`` (``hermes``'s, ERNIE 4.5), ``qwen3_xml`` (``qwen3_coder``'s),
  ``granite4`` (``hermes``'s, IBM Granite 4), ``step3p5`` (``qwen3_coder``'s, Step-3.5),
  ``ling3``, ``poolside_v1`` and ``glm47`` (``glm45``'s, as GLM-4.7 writes it: no newline
  needed after the name);
- ``openai``: gpt-oss's harmony messages to ``functions.NAME``, the arguments their
  content (:mod:`.harmony`); the content is the final messages and preambles;
- ``cohere_command3``, ``cohere_command4``: Command's ``<|START_ACTION|>`` parts, each a
  JSON list ``[{"tool_call_id", "tool_name", "parameters"}]`` (:mod:`.cohere`); the
  call's id is the model's ``tool_call_id``; the content is the answer's parts;
- ``minimax_m3``: in ``]<]minimax[>[<tool_call>`` ... ``]<]minimax[>[</tool_call>``, blocks
  ``]<]minimax[>[<invoke name="NAME">`` + a tag a parameter, ``]<]minimax[>[<KEY>VALUE
  ]<]minimax[>[</KEY>`` + ``]<]minimax[>[</invoke>`` (MiniMax-M3; :mod:`.minimax_m3`), a
  text value typed by its schema, a value of tags an object (or an array of ``<item>`` tags),
  each nested value typed by its own schema;
- ``kimi_k3``: Kimi K3's XTML ``<|open|>call tool="NAME"<|sep|>`` blocks of typed
  arguments in its ``tools`` channel (:mod:`.xtml`); the ``response`` channel's markers
  around the content are left out by the ``kimi_k3`` reasoning parser or, without it, by
  the split (:func:`.xtml.answer`);
- ``kimi_k2``: in ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``,
  blocks ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS
  <|tool_call_end|>`` (Kimi K2); the call's id is the model's own ``functions.NAME:INDEX``
  (its template writes it back in later turns, as vLLM keeps it).

:class:`CallReader` reads an output's text as it grows: a call counts once its text is
complete (a closed block, a closed JSON object, a closed list), so the calls read from a
prefix of the text are the first of those read from the whole, and each is streamed once,
with the id the result gives it.

Streamed, the text outside the calls goes out as ``content`` (:meth:`CallReader.content_so_far`):
the text before where the first call may begin (its marker or opening bracket, or what may
be their start), then, at the end, what follows the last call; so the deltas' pieces add
up to the result's ``content``, and no call's markup is streamed as content.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from ...schemas.tools import ToolUse
from . import blocks, cohere, gemma4_args, harmony, minimax_m3, python_calls, xtml
from .json_compact import DECODER, compact
from .reasoning import held
from .tagged_args import TYPED_ARGS, Types, minicpm5_args, minicpm5_sound

PARSERS: Final = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "glm45",
                  "deepseek_v3", "deepseek_v31", "kimi_k2", "openai", "seed_oss", "minimax_m2",
                  "internlm", "granite", "hunyuan_a13b", "minimax", "phi4_mini_json", "xlam",
                  "longcat", "step3", "jamba", "llama4_json", "llama4_pythonic", "ernie45",
                  "olmo3", "gigachat3", "qwen3_xml", "deepseek_v32", "granite4", "step3p5",
                  "ling3", "poolside_v1", "mimo", "hy_v3", "solar_open2", "lfm2",
                  "deepseek_v4", "granite-20b-fc", "functiongemma", "gemma4",
                  "apertus", "dots", "cohere_command3", "cohere_command4", "glm47",
                  "minicpm5", "kimi_k3", "minimax_m3", "hy_v4", "inkling",
                  "muse_glimmer")  # fmt: skip
"""The values of a model's ``tool_call_parser`` option."""
ALIASES: Final = {"jamba": "hunyuan_a13b", "llama4_json": "llama3_json",
                  "llama4_pythonic": "pythonic", "ernie45": "hermes",
                  "qwen3_xml": "qwen3_coder", "granite4": "hermes", "step3p5": "qwen3_coder",
                  "ling3": "glm45", "poolside_v1": "glm45", "glm47": "glm45"}  # fmt: skip
"""vLLM's names for another parser's format (as vLLM registers them, or the same format)."""
TYPED: Final = tuple(p for p in PARSERS if ALIASES.get(p, p) in TYPED_ARGS)
"""The parsers that type values by the functions' schemas (``Types``)."""
_DS = tuple("<\uff5c" + m.replace(" ", "\u2581") + "\uff5c>" for m in (
    "tool calls begin", "tool calls end", "tool call begin", "tool call end", "tool sep"))  # fmt: skip
_STEP = tuple(f"<\uff5c{m}\uff5c>" for m in (
    "tool_calls_begin", "tool_calls_end", "tool_call_begin", "tool_call_end", "tool_sep"))  # fmt: skip
_V32 = tuple(f"<{end}\uff5cDSML\uff5c{m}" for end, m in (
    ("", "function_calls>"), ("/", "function_calls>"), ("", "invoke"), ("/", "invoke>"),
    ("", "parameter"), ("/", "parameter>")))  # fmt: skip
"""DeepSeek-V3.2's DSML markers (calls begin and end; an invoke's start and end; a
parameter's start and end)."""
_KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_end|>", "<|tool_call_argument_begin|>")  # fmt: skip
_SOLAR = ("<|tool_call:start|>", "<|tool_call:end|>", "<|tool_arg:start|>", "<|tool_arg:value|>",
          "<|tool_arg:end|>")  # fmt: skip
"""Solar Open 2's markers (a call's start and end; an argument's start, value and end)."""
_APERTUS = ("<|tools_prefix|>", "<|tools_suffix|>")
_V4 = ("<\uff5cDSML\uff5ctool_calls>", "</\uff5cDSML\uff5ctool_calls>")
"""DeepSeek-V4's calls' markers (its blocks are DeepSeek-V3.2's)."""
_GEMMA = ("<start_function_call>", "<end_function_call>", "<escape>")
"""FunctionGemma's markers (a call's start and end; a string value's quote)."""
_GEMMA4 = ("<|tool_call>", "<tool_call|>", gemma4_args.DELIM)
"""Gemma 4's markers (a call's start and end; a string value's delimiter)."""
_GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                      "</arg_value>")  # fmt: skip
MARKERS: Final[dict[str, tuple[str, ...]]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "pythonic": ("<|python_start|>", "<|python_end|>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "glm45": _GLM,
    "deepseek_v3": _DS,
    "deepseek_v31": _DS,
    "kimi_k2": _KIMI,
    "openai": harmony.TOKENS,
    "seed_oss": ("<seed:tool_call>", "</seed:tool_call>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "internlm": ("<|action_start|>", "<|plugin|>", "<|action_end|>"),
    "granite": ("<|tool_call|>",),
    "hunyuan_a13b": ("<tool_calls>", "</tool_calls>"),
    "minimax": ("<tool_calls>", "</tool_calls>"),
    "phi4_mini_json": ("functools",),
    "xlam": ("[TOOL_CALLS]", "<tool_call>", "</tool_call>"),
    "longcat": ("<longcat_tool_call>", "</longcat_tool_call>"),
    "step3": _STEP,
    "jamba": ("<tool_calls>", "</tool_calls>"),
    "llama4_json": ("<|python_tag|>",),
    "llama4_pythonic": ("<|python_start|>", "<|python_end|>"),
    "ernie45": ("<tool_call>", "</tool_call>"),
    "olmo3": (python_calls.OPEN, python_calls.CLOSE),
    "gigachat3": ("<|message_sep|>", "<|role_sep|>", "<|function_call|>"),
    "qwen3_xml": ("<tool_call>", "</tool_call>"),
    "deepseek_v32": _V32[:2],
    "granite4": ("<tool_call>", "</tool_call>"),
    "step3p5": ("<tool_call>", "</tool_call>"),
    "ling3": _GLM,
    "poolside_v1": _GLM,
    "glm47": _GLM,
    "minicpm5": ("<function", "</function>", "<param", "</param>"),
    "kimi_k3": xtml.MARKERS,
    "minimax_m3": (minimax_m3.NS, *minimax_m3.SECTION, *minimax_m3.INVOKE),
    "mimo": ("<tool_call>", "</tool_call>"),
    "hy_v3": ("<tool_calls>", "</tool_calls>", "<tool_sep>", *_GLM),
    "solar_open2": _SOLAR,
    "lfm2": (python_calls.LFM2_START, python_calls.LFM2_END),
    "apertus": _APERTUS,
    "dots": ("<dots_function_call>", "</dots_function_call>"),
    "cohere_command3": cohere.FORMATS["cohere_command3"].tokens,
    "cohere_command4": cohere.FORMATS["cohere_command4"].tokens,
    "deepseek_v4": _V4,
    "granite-20b-fc": ("<function_call>",),
    "functiongemma": _GEMMA,
    "gemma4": _GEMMA4,
    **{name: fmt.tokens for name, fmt in blocks.FORMATS.items()},
}
"""Each parser's markers. Where a tokenizer makes one a special token (which decoding
skips), the text of a request the parser reads keeps it (vLLM's parsers turn off
``skip_special_tokens`` for the same reason)."""


@dataclass(frozen=True, slots=True)
class _Found:
    start: int
    end: int
    """Where its text lies (the first call's start and the last's end bound the calls'
    part of the text, markers and brackets included)."""
    name: str
    args: dict[str, Any]
    id: str | None = None
    """The model's own id for the call (``kimi_k2``; None: one is made)."""


"""Per function, its parameters' JSON Schema types (``qwen3_coder`` types its values)."""
Scan = Callable[[str, bool], list[_Found]]
"""The calls complete in a text (``True``: the text is whole, so one cut at its end that
still parses counts too)."""
Resume = Callable[[str, bool, int], tuple[list[_Found], int]]
"""A scan from an offset where an earlier, shorter text was settled; it returns the calls
from there and the new settled offset: the text before it reads the same however the
text goes on (0: never settled, read from the start each time)."""


class CallReader:
    """One output's tool calls, read as its text grows (see the module docstring)."""

    __slots__ = ("_at", "_harmony", "_hold", "_scan", "_section", "_settled", "calls",
                 "content", "end", "limit", "sent")  # fmt: skip

    def __init__(self, use: ToolUse, parser: str | None, types: Types | None = None) -> None:
        parser = ALIASES.get(parser or "", parser)
        self._scan = _scanner(use, parser, types or {})
        self._hold = _holder(use, parser)
        self._section = _SECTIONS.get(parser or "") if use.kind == "auto" else None
        self._harmony = parser == "openai"
        """The text is harmony messages (whatever the tool choice): its content is
        theirs, not the text outside the calls."""
        self.limit = None if use.parallel else 1
        """How many calls count (None: all; ``parallel_tool_calls`` false: the first)."""
        self._at = 0
        self._settled: list[_Found] = []
        """The calls before ``_at``, where the text read last was settled."""
        self.calls: list[dict[str, Any]] = []
        """Read so far, in order, as a result's ``tool_calls``."""
        self.sent = 0
        """How many of them were streamed."""
        self.content: str | None = None
        """After a final read that found calls: the text outside them (OpenAI's message
        ``content``), trimmed."""
        self.end = 0
        """Where the last call read ends in the text (0: none read)."""

    def read(self, text: str, final: bool = False) -> None:
        """Take the output's text so far (``final``: all of it); each text given is the
        one before and more."""
        new, settled = self._scan(text, final, self._at)
        found = self._settled + new
        if settled > self._at:
            self._settled += [f for f in new if f.end <= settled]
            self._at = settled
        for f in found[len(self.calls) : self.limit]:
            self.calls.append(_call(f.name, f.args, f.id))
            self.end = f.end
        if final and self.calls:
            start, end = found[0].start, found[-1].end
            if self._section is not None:  # the section's markers are the calls' too
                begin, close = self._section
                at = text.rfind(begin, 0, start)
                if at >= 0 and not text[at + len(begin) : start].strip():
                    start = at
                if text.startswith(close, _skip(text, end)):
                    end = _skip(text, end) + len(close)
            self.content = (
                harmony.content(text) if self._harmony else (text[:start] + text[end:]).strip()
            )

    def content_so_far(self, text: str) -> str:
        """The content a text so far shows for certain (a start of the whole text's
        ``content``): its text before where a call may begin, trimmed (harmony: its
        final messages' and preambles')."""
        if self._harmony:
            return harmony.content(text)
        return text[: self._hold(text)].strip()

    def may_call(self, text: str) -> bool:
        """Whether a call may have begun in a text so far."""
        return self._hold(text) < len(text)

    @staticmethod
    def may_complete(new: str) -> bool:
        """Whether text ``new`` (just released) may complete a call: a call's text ends
        with one of ``>}]``, so text without them is not worth reading again."""
        return ">" in new or "}" in new or "]" in new

    def unsent(self) -> list[dict[str, Any]]:
        """The calls read since this was last asked."""
        out = self.calls[self.sent :]
        self.sent = len(self.calls)
        return out


def read_calls(use: ToolUse, text: str, parser: str | None,
               types: Types | None = None) -> list[dict[str, Any]] | None:  # fmt: skip
    """The calls a whole ``text`` makes, as a result's ``tool_calls`` (None: none)."""
    reader = CallReader(use, parser, types)
    reader.read(text, final=True)
    return reader.calls or None


def _scanner(use: ToolUse, parser: str | None, types: Types) -> Resume:
    if parser == "openai":  # harmony calls, whatever the tool choice (harmony.calls_grammar)
        return _whole(_openai)
    if parser in blocks.FORMATS:  # its call blocks, whatever the tool choice
        read = blocks.FORMATS[parser].read_calls
        return _whole(lambda text, final: [_Found(*c) for c in read(text, final, types)])
    if use.kind == "named":
        assert use.name is not None
        return _whole(_named(use.name))
    if use.kind == "required":
        return _whole(_required)
    if parser in SECTIONED:
        return _whole(_sectioned(parser or "", types))
    if parser in _BLOCKS:
        opening, closing, body = _BLOCKS[parser]
        scan = _blocks(opening, closing, body, types)
        return _with_dots_json(scan, types) if parser == "dots" else scan
    return _whole(_SCANNERS.get(parser or "", _none))


def _holder(use: ToolUse, parser: str | None) -> Callable[[str], int]:
    """Where, in a text so far, a call may begin: the text before is content whatever
    follows (see the module docstring)."""
    if parser == "openai":
        return harmony.call_start
    if parser in cohere.FORMATS:
        return _marked(cohere.START_ACTION)
    if parser in blocks.FORMATS:
        return blocks.FORMATS[parser].call_start
    if use.kind != "auto":  # the text is the calls
        return lambda text: 0
    if parser in _SECTIONS:
        return _marked(_SECTIONS[parser][0])
    if parser in _BLOCKS:
        return _marked(_BLOCKS[parser][0])
    if parser in ("mistral", "granite", "olmo3", "lfm2", "granite-20b-fc"):
        return _marked(MARKERS[parser][0])
    if parser == "gigachat3":  # (vLLM's content: the text before <|message_sep|> or the call)
        return _marked("<|message_sep|>", "function call<|role_sep|>", "<|function_call|>")
    if parser == "phi4_mini_json":
        return _before_array(("functools",))
    if parser == "xlam":
        lead = _leading("[", "[")
        fenced = _before_array(("```json", "```", "[TOOL_CALLS]", "<tool_call>"))
        return lambda text: min(lead(text), fenced(text))
    if parser == "llama3_json":
        return _leading("<|python_tag|>", "{")
    if parser == "pythonic":
        return _leading("<|python_start|>", "[")
    return len


def _marked(*markers: str) -> Callable[[str], int]:
    """Calls begin at the first of ``markers``."""

    def hold(text: str) -> int:
        found = [at for m in markers if (at := text.find(m)) >= 0]
        if found:
            return min(found)
        return len(text) - max(held(text, m) for m in markers)  # a start of one, perhaps

    return hold


def _before_array(markers: tuple[str, ...]) -> Callable[[str], int]:
    """Calls begin at a marker that a JSON array follows: the first one whose text so far
    may go on so (nothing but whitespace yet, or ``[``), or a marker's start at the end."""

    def hold(text: str) -> int:
        cut = len(text) - max(held(text, m) for m in markers)
        for m in markers:
            at = text.find(m)
            while 0 <= at < cut:
                i = _skip(text, at + len(m))
                if i == len(text) or text[i] == "[":
                    cut = at
                    break
                at = text.find(m, at + 1)
        return cut

    return hold


def _leading(marker: str, bracket: str) -> Callable[[str], int]:
    """Calls are the whole text, which begins with ``marker`` or ``bracket``."""

    def hold(text: str) -> int:
        i = _skip(text, 0)
        head = text[i : i + len(marker)]
        if head.startswith(bracket) or marker.startswith(head):
            return i  # calls, perhaps (or nothing yet)
        return len(text)

    return hold


def _whole(scan: Scan) -> Resume:
    """A scan that reads the whole text each time."""

    def resume(text: str, final: bool, start: int) -> tuple[list[_Found], int]:
        return scan(text, final), 0

    return resume


def _none(text: str, final: bool) -> list[_Found]:
    return []


def _named(name: str) -> Scan:
    def scan(text: str, final: bool) -> list[_Found]:
        i = _skip(text, 0)
        got = _decode(text, i)
        if got is None or not isinstance(got[0], dict):
            return []
        return [_Found(0, got[1], name, got[0])]

    return scan


def _required(text: str, final: bool) -> list[_Found]:
    i = _skip(text, 0)
    if not text.startswith("[", i):
        return []
    return _from(0, _closed(text, _entries(text, i + 1, ",", "]")))


Body = Callable[[str, Types], "tuple[str, dict[str, Any], str | None] | None"]
"""A block's call read from its text between the markers (name, arguments, the model's
id), given the functions' types; None: not a call."""


def _blocks(opening: str, closing: str, body: Body, types: Types, cut: bool = True) -> Resume:
    """Calls in blocks, each from an ``opening`` marker to the next ``closing`` one (a
    block cut by the end read too, where the text is whole, unless not ``cut``); settled
    after the last closed block (the blocks are read apart)."""

    def scan(text: str, final: bool, start: int) -> tuple[list[_Found], int]:
        out: list[_Found] = []
        i = text.find(opening, start)
        while i >= 0:
            j = text.find(closing, i + len(opening))
            if j < 0 and not (final and cut):
                break
            end = len(text) if j < 0 else j + len(closing)
            got = body(text[i + len(opening) : len(text) if j < 0 else j], types)
            if got is not None:
                out.append(_Found(i, end, *got))
            if j < 0:
                break
            start = end
            i = text.find(opening, start)
        return out, start

    return scan


def _sectioned(parser: str, types: Types) -> Scan:
    """A :data:`SECTIONED` parser's calls: the blocks of its first closed section, where
    each is a sound call and nothing else is between its markers (else none)."""
    opening, closing, body = _BLOCKS[parser]
    begin, close = _SECTIONS[parser]
    sound = SECTIONED[parser]

    def scan(text: str, final: bool) -> list[_Found]:
        at = text.find(begin)
        end = text.find(close, at + len(begin)) if at >= 0 else -1
        inner = text[at + len(begin) : end]
        if end < 0 or inner.count(opening) != inner.count(closing):
            return []
        found = _blocks(opening, closing, body, types, cut=False)(inner, True, 0)[0]
        blocks = [inner[f.start + len(opening) : f.end - len(closing)] for f in found]
        if not found or len(found) != inner.count(opening) or not all(map(sound, blocks)):
            return []
        shift = at + len(begin)
        out = [_Found(f.start + shift, f.end + shift, f.name, f.args, f.id) for f in found]
        out[-1] = _Found(out[-1].start, len(text), out[-1].name, out[-1].args, out[-1].id)
        return out

    return scan


def _with_dots_json(blocks: Resume, types: Types) -> Resume:
    """``dots``'s blocks, and its sections that are a JSON call each (vLLM's fallback),
    in the text's order."""

    def resume(text: str, final: bool, start: int) -> tuple[list[_Found], int]:
        found = blocks(text, final, 0)[0] + _dots_json(text, final, types)
        return sorted(found, key=lambda f: f.start), 0

    return resume


def _dots_json(text: str, final: bool, types: Types) -> list[_Found]:
    """The ``dots`` sections that are one JSON object ``{"name", "arguments" (or
    "parameters")}`` of a function the request has, once the section closes (or the
    text, whole, ends)."""
    begin, close = _SECTIONS["dots"]
    out: list[_Found] = []
    at = text.find(begin)
    while at >= 0:
        i = _skip(text, at + len(begin))
        got = _decode(text, i) if text.startswith("{", i) else None
        if got is not None and isinstance(got[0], dict):
            after = _skip(text, got[1])
            name = got[0].get("name")
            args = got[0].get("arguments", got[0].get("parameters", {})) or {}
            if ((text.startswith(close, after) or (final and after == len(text)))
                    and isinstance(name, str) and name in types and isinstance(args, dict)):  # fmt: skip
                out.append(_Found(at, got[1], name, args))
        at = text.find(begin, at + len(begin))
    return out


def _hermes_body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
    found = _entry(_json(text), 0, 0)
    return None if found is None else (found.name, found.args, None)


_FUNCTION = re.compile(r"\s*<function=([^>\n]{1,64})>(.*?)</function>", re.DOTALL)


def _typed_body(header: re.Pattern[str], parser: str) -> Body:
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
_DOTS_INVOKE = re.compile(r"""\s+name\s*=\s*["']?([^"'>\n]{1,64}?)["']?\s*>""")
_V32_INVOKE = re.compile(r'\s+name="([^"\n]{1,64})"\s*>')


_DS_V3 = re.compile(r"\s*\w*\s*" + re.escape(_DS[4]) +
                    r"\s*([^\n]{1,64}?)\s*\n```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)  # fmt: skip
_DS_V31 = re.compile(r"\s*([^\n<]{1,64}?)\s*" + re.escape(_DS[4]) + r"(.*)$", re.DOTALL)


def _deepseek_body(pattern: re.Pattern[str]) -> Body:
    def body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
        m = pattern.match(text)
        args = None if m is None else _json(m.group(2))
        if m is None or not isinstance(args, dict):
            return None
        return m.group(1), args, None

    return body


_STEP3_INVOKE = re.compile(r"\s*function\s*" + re.escape(_STEP[4]) +
                           r'\s*<steptml:invoke name="([^"\n]{1,64})">')  # fmt: skip
_KIMI_CALL = re.compile(r"\s*((?:functions\.)?([^\s:<]{1,64}):\d{1,6})\s*"
                        r"<\|tool_call_argument_begin\|>(.*)$", re.DOTALL)  # fmt: skip


def _kimi_k2_body(text: str, types: Types) -> tuple[str, dict[str, Any], str] | None:
    m = _KIMI_CALL.match(text)
    args = None if m is None else _json(m.group(3))
    if m is None or not isinstance(args, dict):
        return None
    return m.group(2), args, m.group(1)


_HY_NAME = re.compile(r"\s*([^<\n]{1,64}?)\s*<tool_sep>")
_SOLAR_NAME = re.compile(r"\s*([^\s<][^<\n]{0,63}?)[^\S\n]*\n")
"""Solar Open 2's call header: the name, a line of its own (the rest of the start
marker's, as the model writes it)."""

_GEMMA_CALL = re.compile(r"\s*call:(\w+)\{")
"""FunctionGemma's call header: ``call:NAME{`` (vLLM's: a name of word characters)."""

_GEMMA4_CALL = re.compile(r"call:([\w\-.]+)\{(.*)\}\Z", re.DOTALL)
"""A Gemma 4 call: ``call:NAME{ARGUMENTS}``, the block's whole text (vLLM's)."""


def _gemma4_body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
    m = _GEMMA4_CALL.match(text)
    return None if m is None else (m.group(1), gemma4_args.read(m.group(2)), None)


_MINICPM5_NAME = re.compile(r"""\s*name=['"]([^'"\n]{1,64})['"][^>]*>""")
"""A MiniCPM5 call's header, after ``<function``: its name."""


def _minicpm5_body(text: str, types: Types) -> tuple[str, dict[str, Any], None] | None:
    m = _MINICPM5_NAME.match(text)
    name = "" if m is None else m.group(1).strip()
    if m is None or name not in types or not minicpm5_sound(text, m.end(), types[name]):
        return None
    return name, minicpm5_args(text, m.end(), types[name]), None


KNOWN_ONLY: Final = frozenset({"dots", "minicpm5"})
"""The parsers for which a call of a function the request does not have is none (vLLM's
``dots`` and ``minicpm5``)."""
_BLOCKS: Final[dict[str, tuple[str, str, Body]]] = {
    "hermes": ("<tool_call>", "</tool_call>", _hermes_body),
    "qwen3_coder": ("<tool_call>", "</tool_call>", _typed_body(_FUNCTION, "qwen3_coder")),
    "glm45": ("<tool_call>", "</tool_call>", _typed_body(_GLM_NAME, "glm45")),
    "deepseek_v3": (_DS[2], _DS[3], _deepseek_body(_DS_V3)),
    "deepseek_v31": (_DS[2], _DS[3], _deepseek_body(_DS_V31)),
    "kimi_k2": (_KIMI[2], _KIMI[3], _kimi_k2_body),
    "seed_oss": ("<seed:tool_call>", "</seed:tool_call>", _typed_body(_FUNCTION, "seed_oss")),
    "minimax_m2": ("<invoke", "</invoke>", _typed_body(_INVOKE, "minimax_m2")),
    "internlm": ("<|action_start|><|plugin|>", "<|action_end|>", _hermes_body),
    "longcat": ("<longcat_tool_call>", "</longcat_tool_call>", _hermes_body),
    "step3": (_STEP[2], _STEP[3], _typed_body(_STEP3_INVOKE, "step3")),
    "deepseek_v32": (_V32[2], _V32[3], _typed_body(_V32_INVOKE, "deepseek_v32")),
    "mimo": ("<tool_call>", "</tool_call>", _typed_body(_FUNCTION, "mimo")),
    "hy_v3": ("<tool_call>", "</tool_call>", _typed_body(_HY_NAME, "hy_v3")),
    "solar_open2": (_SOLAR[0], _SOLAR[1], _typed_body(_SOLAR_NAME, "solar_open2")),
    "dots": ("<invoke", "</invoke>", _typed_body(_DOTS_INVOKE, "dots")),
    "deepseek_v4": (_V32[2], _V32[3], _typed_body(_V32_INVOKE, "deepseek_v4")),
    "functiongemma": (_GEMMA[0], _GEMMA[1], _typed_body(_GEMMA_CALL, "functiongemma")),
    "gemma4": (_GEMMA4[0], _GEMMA4[1], _gemma4_body),
    "minicpm5": ("<function", "</function>", _minicpm5_body),
    "kimi_k3": (*xtml.CALL, xtml.body),
    "minimax_m3": (*minimax_m3.INVOKE, _typed_body(minimax_m3.HEADER, "minimax_m3")),
}
"""The parsers whose calls are blocks: their markers and how a block's text reads."""
SECTIONED: Final[dict[str, Callable[[str], bool]]] = {}
"""The block parsers whose calls are their first section's blocks, once it closes, all or
none (vLLM's ``hy_v4``, strict): each with whether a block's text (between its markers) is
written soundly; the text after the section is the calls' too (the content is what
precedes it)."""
_SECTIONS: Final[dict[str, tuple[str, str]]] = {
    "deepseek_v3": (_DS[0], _DS[1]),
    "deepseek_v31": (_DS[0], _DS[1]),
    "kimi_k2": (_KIMI[0], _KIMI[1]),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "hunyuan_a13b": ("<tool_calls>", "</tool_calls>"),
    "minimax": ("<tool_calls>", "</tool_calls>"),
    "step3": (_STEP[0], _STEP[1]),
    "deepseek_v32": (_V32[0], _V32[1]),
    "hy_v3": ("<tool_calls>", "</tool_calls>"),
    "apertus": _APERTUS,
    "dots": ("<dots_function_call>", "</dots_function_call>"),
    "deepseek_v4": _V4,
    "kimi_k3": xtml.TOOLS,
    "minimax_m3": minimax_m3.SECTION,
}
"""The markers around a parser's calls, where it has them (its blocks', or its array's)."""


def _llama3_json(text: str, final: bool) -> list[_Found]:
    start = i = _skip(text, 0)
    if text.startswith("<|python_tag|>", i):
        i = _skip(text, i + len("<|python_tag|>"))
    if not text.startswith("{", i):
        return []
    return _from(start, list(_entries(text, i, ";", None)))


_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def _after(marker: str, read: Callable[[str, int], list[_Found]]) -> Scan:
    """Calls after each ``marker``, read from where its text goes on (``read``)."""

    def scan(text: str, final: bool) -> list[_Found]:
        out: list[_Found] = []
        at = text.find(marker)
        while at >= 0:
            i = _skip(text, at + len(marker))
            nxt = text.find(marker, i)
            out += _from(at, read(text, i))
            at = nxt
        return out

    return scan


def _array(text: str, i: int) -> list[_Found]:
    """The calls of a JSON array at ``i``."""
    return _closed(text, _entries(text, i + 1, ",", "]")) if text.startswith("[", i) else []


def _keyed_array(text: str, i: int) -> list[_Found]:
    """The calls of a JSON array at ``i`` of objects ``{NAME: ARGUMENTS}`` (Apertus's)."""
    if not text.startswith("[", i):
        return []
    return _closed(text, _entries(text, i + 1, ",", "]", _keyed))


def _one(text: str, i: int) -> list[_Found]:
    """The call that is the JSON object at ``i``, if complete and a call."""
    got = _decode(text, i)
    found = None if got is None else _entry(got[0], i, got[1])
    return [] if found is None else [found]


def _mistral_calls(text: str, i: int) -> list[_Found]:
    """A JSON array of calls, or newer tokenizers' ``name[ARGS]{...}``."""
    if (m := _MISTRAL_NAME.match(text, i)) is None:
        return _array(text, i)
    got = _decode(text, _skip(text, m.end()))
    calls = [] if got is None else [_Found(i, got[1], m.group(1), got[0])]
    return [f for f in calls if isinstance(f.args, dict)]


_XLAM: Final = re.compile(r"\A\s*(?=\[(?!TOOL_CALLS\]))|```(?:json)?|\[TOOL_CALLS\]|<tool_call>")
"""Where an ``xlam`` array may begin: the text's start, a fence, or a marker."""
_XLAM_CLOSE: Final = {"`": "```", "<": "</tool_call>"}


def _xlam(text: str, final: bool) -> list[_Found]:
    """JSON arrays of calls where :data:`_XLAM` finds them (an array's closing fence or
    ``</tool_call>`` is its calls' markup); read up to an array not complete."""
    out: list[_Found] = []
    at = 0
    while (m := _XLAM.search(text, at)) is not None:
        i = _skip(text, m.end())
        if not text.startswith("[", i):
            at = m.end()
            continue
        found = _from(m.start(), _array(text, i))
        got = _decode(text, i)
        if got is None:  # cut (or not JSON): what follows is not read
            return out + found
        at = got[1]
        close = _XLAM_CLOSE.get(m.group()[:1])
        if close is not None and text.startswith(close, _skip(text, at)):
            at = _skip(text, at) + len(close)
            if found:
                last = found[-1]
                found[-1] = _Found(last.start, at, last.name, last.args)
        out += found
    return out


_GIGACHAT: Final = re.compile(r"(?:<\|message_sep\|>\s*)?function call<\|role_sep\|>"
                              r"|<\|function_call\|>")  # fmt: skip
"""GigaChat 3's call header (its ``<|message_sep|>`` before it the calls' too), or 3.1's."""


def _gigachat3(text: str, final: bool) -> list[_Found]:
    """A JSON call after each header (vLLM's reads the first)."""
    out: list[_Found] = []
    at = 0
    while (m := _GIGACHAT.search(text, at)) is not None:
        got = _decode(text, _skip(text, m.end()))
        found = None if got is None else _entry(got[0], m.start(), got[1])
        if found is not None:
            out.append(found)
        at = m.end()  # (in a call's strings a header is followed by escaped quotes: no call)
    return out


def _python(read: Callable[[str], python_calls.Calls | None]) -> Scan:
    """Calls written in Python, where ``read`` finds them."""

    def scan(text: str, final: bool) -> list[_Found]:
        got = read(text)
        if got is None:
            return []
        start, end, calls = got
        return [_Found(start, end, name, args) for name, args in calls]

    return scan


def _lfm2(text: str, final: bool) -> list[_Found]:
    """LFM2's list of calls in its first block, once closed (or the text whole); where the
    model echoes the calls after it, capped by another end marker, the echo is the calls'
    markup too (vLLM's leaves it out of the content)."""
    got = python_calls.read_marked(text, final)
    if got is None:
        return []
    start, end, calls = got
    if final and (last := text.rfind(python_calls.LFM2_END)) >= end:
        end = last + len(python_calls.LFM2_END)
    return [_Found(start, end, name, args) for name, args in calls]


def _openai(text: str, final: bool) -> list[_Found]:
    """Harmony messages to ``functions.NAME`` whose content is a JSON object, once ended
    (``<|call|>``, which ends the generation, is not in the text: the text's end)."""
    out: list[_Found] = []
    for m in harmony.messages(text):
        name = m.call
        if name and m.body is not None and (m.closed or final):
            args = _json(text[m.body : m.end])
            if isinstance(args, dict):
                out.append(_Found(m.at, m.after, name, args))
    return out


_SCANNERS: Final[dict[str, Scan]] = {
    "mistral": _after("[TOOL_CALLS]", _mistral_calls),
    "granite": _after("<|tool_call|>", _array),
    "hunyuan_a13b": _after("<tool_calls>", _array),
    "minimax": _after("<tool_calls>", lambda text, i: list(_entries(text, i, None, "<"))),
    "phi4_mini_json": _after("functools", _array),
    "apertus": _after(_APERTUS[0], _keyed_array),
    "xlam": _xlam,
    "openai": _openai,
    "llama3_json": _llama3_json,
    "pythonic": _python(python_calls.read_list),
    "olmo3": _python(python_calls.read_lines),
    "lfm2": _lfm2,
    "gigachat3": _gigachat3,
    "cohere_command3": lambda text, final: [_Found(*c) for c in cohere.calls(text, final)],
    "cohere_command4": lambda text, final: [_Found(*c) for c in cohere.calls(text, final)],
    "granite-20b-fc": _after("<function_call>", _one),
}
"""The parsers that read the whole text each time."""
LATER: Final = frozenset({"hy_v4"})
"""The parsers whose tables are filled at load, from the tokenizer (:mod:`.hy_v4`)."""
assert set(_SCANNERS) | set(_BLOCKS) | set(ALIASES) | set(blocks.FORMATS) | LATER == set(PARSERS)
assert set(MARKERS) | LATER == set(PARSERS)


def _entries(text: str, i: int, sep: str | None, close: str | None,
             entry: Callable[[Any, int, int], _Found | None] | None = None) -> Iterator[_Found]:  # fmt: skip
    """Calls written as complete JSON objects from ``i`` on, separated by ``sep`` (None:
    whitespace only), up to ``close`` or the first that is not complete (or not a call:
    left out, read on); each read by ``entry`` (None: :func:`_entry`)."""
    entry = entry or _entry
    n = len(text)
    while True:
        i = _skip(text, i)
        if i >= n or text[i] == close:
            return
        got = _decode(text, i)
        if got is None:
            return
        value, end = got
        if (found := entry(value, i, end)) is not None:
            yield found
        i = _skip(text, end)
        if sep is None:
            continue
        if i >= n or text[i] != sep:
            return
        i += 1


def _closed(text: str, found: Iterator[_Found]) -> list[_Found]:
    """``found`` (read from an array), the last one's end moved past the array's ``]``."""
    out = list(found)
    if out:
        j = _skip(text, out[-1].end)
        while text.startswith(",", j):  # entries that are not calls
            j = _skip(text, j + 1)
            got = _decode(text, j)
            if got is None:
                break
            j = _skip(text, got[1])
        if text.startswith("]", j):
            last = out[-1]
            out[-1] = _Found(last.start, j + 1, last.name, last.args)
    return out


def _from(start: int, found: list[_Found]) -> list[_Found]:
    """``found``, the first one's text taken to begin at ``start`` (a marker, a bracket)."""
    if found:
        first = found[0]
        found[0] = _Found(start, first.end, first.name, first.args)
    return found


def _entry(value: Any, start: int, end: int) -> _Found | None:
    """A call ``{"name": ..., "arguments" (or "parameters"): {...}}``; None if ``value``
    is not one (arguments may be JSON text of an object)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):
        args = _json(args)
    if not (isinstance(name, str) and name and isinstance(args, dict)):
        return None
    return _Found(start, end, name, args)


def _keyed(value: Any, start: int, end: int) -> _Found | None:
    """A call ``{NAME: {...}}`` (its one key the name); None if ``value`` is not one."""
    if not (isinstance(value, dict) and len(value) == 1):
        return None
    ((name, args),) = value.items()
    return _Found(start, end, name, args) if name and isinstance(args, dict) else None


def _call(name: str, args: dict[str, Any], cid: str | None = None) -> dict[str, Any]:
    return {"id": cid or new_id(), "type": "function",
            "function": {"name": name, "arguments": compact(args)}}  # fmt: skip


def new_id() -> str:
    """A call's id, where the model gives none (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def _decode(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value at ``i`` and where it ends (None: none complete there)."""
    try:
        return DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None


def _json(text: str) -> Any:
    try:
        return DECODER.decode(text)
    except (ValueError, RecursionError):
        return None
