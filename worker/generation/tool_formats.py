"""The tool-call formats: the ``tool_call_parser`` names (vLLM's), and each format's markers
and sections, the tables the readers (:mod:`.tools`, :mod:`.tool_chunks`,
:mod:`.strict_calls`) look a parser up in.

With ``tool_choice`` ``auto`` the text is free, and the parser for the model's own format
finds the calls:

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
  written twice or without its name, or without a ``required`` one, is none; its text
  cleaned up first (tokenizer artefacts, tags run together) and its whole text's content
  what follows its last ``</think>`` (:mod:`.minicpm5_text`);
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
"""

from __future__ import annotations

from typing import Final

from . import blocks, cohere, gemma4_args, harmony, minimax_m3, python_calls, xtml
from .tagged_args import TYPED_ARGS

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
DS = tuple("<\uff5c" + m.replace(" ", "\u2581") + "\uff5c>" for m in (
    "tool calls begin", "tool calls end", "tool call begin", "tool call end", "tool sep"))  # fmt: skip
"""DeepSeek-V3's markers (calls begin and end; a call's begin and end; the separator)."""
STEP = tuple(f"<\uff5c{m}\uff5c>" for m in (
    "tool_calls_begin", "tool_calls_end", "tool_call_begin", "tool_call_end", "tool_sep"))  # fmt: skip
"""Step-3's markers (calls begin and end; a call's begin and end; the separator)."""
V32 = tuple(f"<{end}\uff5cDSML\uff5c{m}" for end, m in (
    ("", "function_calls>"), ("/", "function_calls>"), ("", "invoke"), ("/", "invoke>"),
    ("", "parameter"), ("/", "parameter>")))  # fmt: skip
"""DeepSeek-V3.2's DSML markers (calls begin and end; an invoke's start and end; a
parameter's start and end)."""
KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_end|>", "<|tool_call_argument_begin|>")  # fmt: skip
"""Kimi K2's markers (the section's begin and end; a call's begin and end; its arguments'
begin)."""
SOLAR = ("<|tool_call:start|>", "<|tool_call:end|>", "<|tool_arg:start|>", "<|tool_arg:value|>",
          "<|tool_arg:end|>")  # fmt: skip
"""Solar Open 2's markers (a call's start and end; an argument's start, value and end)."""
APERTUS = ("<|tools_prefix|>", "<|tools_suffix|>")
"""Apertus's markers (before and after its array of calls)."""
V4 = ("<\uff5cDSML\uff5ctool_calls>", "</\uff5cDSML\uff5ctool_calls>")
"""DeepSeek-V4's calls' markers (its blocks are DeepSeek-V3.2's)."""
GEMMA = ("<start_function_call>", "<end_function_call>", "<escape>")
"""FunctionGemma's markers (a call's start and end; a string value's quote)."""
GEMMA4 = ("<|tool_call>", "<tool_call|>", gemma4_args.DELIM)
"""Gemma 4's markers (a call's start and end; a string value's delimiter)."""
GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                      "</arg_value>")  # fmt: skip
"""GLM-4.5's markers (a call's start and end; a key's; a value's)."""
MARKERS: Final[dict[str, tuple[str, ...]]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "pythonic": ("<|python_start|>", "<|python_end|>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "glm45": GLM,
    "deepseek_v3": DS,
    "deepseek_v31": DS,
    "kimi_k2": KIMI,
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
    "step3": STEP,
    "jamba": ("<tool_calls>", "</tool_calls>"),
    "llama4_json": ("<|python_tag|>",),
    "llama4_pythonic": ("<|python_start|>", "<|python_end|>"),
    "ernie45": ("<tool_call>", "</tool_call>"),
    "olmo3": (python_calls.OPEN, python_calls.CLOSE),
    "gigachat3": ("<|message_sep|>", "<|role_sep|>", "<|function_call|>"),
    "qwen3_xml": ("<tool_call>", "</tool_call>"),
    "deepseek_v32": V32[:2],
    "granite4": ("<tool_call>", "</tool_call>"),
    "step3p5": ("<tool_call>", "</tool_call>"),
    "ling3": GLM,
    "poolside_v1": GLM,
    "glm47": GLM,
    "minicpm5": ("<function", "</function>", "<param", "</param>"),
    "kimi_k3": xtml.MARKERS,
    "minimax_m3": (minimax_m3.NS, *minimax_m3.SECTION, *minimax_m3.INVOKE),
    "mimo": ("<tool_call>", "</tool_call>"),
    "hy_v3": ("<tool_calls>", "</tool_calls>", "<tool_sep>", *GLM),
    "solar_open2": SOLAR,
    "lfm2": (python_calls.LFM2_START, python_calls.LFM2_END),
    "apertus": APERTUS,
    "dots": ("<dots_function_call>", "</dots_function_call>"),
    "cohere_command3": cohere.FORMATS["cohere_command3"].tokens,
    "cohere_command4": cohere.FORMATS["cohere_command4"].tokens,
    "deepseek_v4": V4,
    "granite-20b-fc": ("<function_call>",),
    "functiongemma": GEMMA,
    "gemma4": GEMMA4,
    **{name: fmt.tokens for name, fmt in blocks.FORMATS.items()},
}
"""Each parser's markers. Where a tokenizer makes one a special token (which decoding
skips), the text of a request the parser reads keeps it (vLLM's parsers turn off
``skip_special_tokens`` for the same reason)."""

SECTIONS: Final[dict[str, tuple[str, str]]] = {
    "deepseek_v3": (DS[0], DS[1]),
    "deepseek_v31": (DS[0], DS[1]),
    "kimi_k2": (KIMI[0], KIMI[1]),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "hunyuan_a13b": ("<tool_calls>", "</tool_calls>"),
    "minimax": ("<tool_calls>", "</tool_calls>"),
    "step3": (STEP[0], STEP[1]),
    "deepseek_v32": (V32[0], V32[1]),
    "hy_v3": ("<tool_calls>", "</tool_calls>"),
    "apertus": APERTUS,
    "dots": ("<dots_function_call>", "</dots_function_call>"),
    "deepseek_v4": V4,
    "kimi_k3": xtml.TOOLS,
    "minimax_m3": minimax_m3.SECTION,
}
"""The markers around a parser's calls, where it has them (its blocks', or its array's)."""
LATER: Final = frozenset({"hy_v4"})
"""The parsers whose tables are filled at load, from the tokenizer (:mod:`.hy_v4`)."""
assert set(MARKERS) | LATER == set(PARSERS)
