"""``tool_choice`` ``auto`` with ``strict`` functions (OpenAI's ``strict: true``; vLLM's
structural tags): the text stays free, but once the model writes a call's opening marker,
the call follows the model's format and its function's schema, to the closing marker.

The constraint is a Lark grammar (llguidance's, as its ``StructTag`` builds them): free
text, and calls, each free text ended by the opening marker, then a JSON object
``{"name": ..., "arguments": ...}`` that is one of the functions' (a ``strict``
function's arguments follow its ``parameters``; another's are any object), then the
closing marker. Where the tokenizer makes a marker a special token, the grammar names the
token (``<|name|>``, or ``<[id]>`` for Mistral's ``[TOOL_CALLS]``), which free text
cannot write; else the marker is text, and the free text before it is a lazy lexeme that
ends where the marker is written. Built: calls in JSON blocks, arrays or runs of them
after a marker (:data:`BLOCKS`); calls that are the whole text (:data:`LEADING`: a text
that begins with ``{`` or the marker is held to calls, one that begins otherwise is
free); named calls in a section (:data:`SECTIONS`); blocks with tagged parameters
(:data:`TYPED`); Mistral's (:func:`_mistral`); ``pythonic`` lists of calls
(:mod:`.strict_python`), OLMo 3's (:func:`_olmo3`) and LFM2's (:func:`_lfm2`); GigaChat 3's
(:func:`_gigachat3`); Gemma 4's (:func:`_gemma4`); and xLAM's (:func:`_xlam`): every format
but :data:`UNHELD`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from . import python_calls, strict_python
from .tool_formats import DS, GEMMA, GEMMA4, KIMI, SOLAR, STEP, V4, V32

BLOCKS: Final[dict[str, tuple[str, str, str, str]]] = {
    "hermes": ("<tool_call>", "</tool_call>", "one", "arguments"),
    "longcat": ("<longcat_tool_call>", "</longcat_tool_call>", "one", "arguments"),
    "internlm": ("<|action_start|><|plugin|>", "<|action_end|>", "one", "parameters"),
    "granite": ("<|tool_call|>", "", "array", "arguments"),
    "hunyuan_a13b": ("<tool_calls>", "</tool_calls>", "array", "arguments"),
    "minimax": ("<tool_calls>", "</tool_calls>", "several", "arguments"),
    "phi4_mini_json": ("functools[", "]", "items", "arguments"),
    "gigachat3": ("<|function_call|>", "", "one", "arguments"),  # 3.1's (3.0: _gigachat3)
    "apertus": ("<|tools_prefix|>", "<|tools_suffix|>", "array", ""),
    "granite-20b-fc": ("<function_call>", "", "one", "arguments"),
}
"""The parsers whose calls a grammar can hold: their opening and closing markers (""
none), what a block holds: ``one`` call, an ``array`` of calls, ``several`` calls one
after another, or ``items``, an array's calls after its ``[`` (in the opening marker, so
prose that writes ``functools`` stays free), and the key of a call's arguments (each call
a JSON object ``{"name", key}``; "": ``{NAME: ARGUMENTS}``, Apertus's). ``gigachat3``: GigaChat 3.1's header, where it is a
token (:func:`grammar`)."""
UNHELD: Final = frozenset({"kimi_k3", "minimax_m3", "inkling", "muse_glimmer"})
"""The formats no grammar here holds (strict functions are not enforced in them): their
markers are written with several special tokens each (Kimi-K3's ``<|open|>``, ``<|sep|>``;
MiniMax-M3's namespace token before each tag, and closing tags that name a parameter), or
their calls are message blocks that vLLM holds to no grammar either (Inkling's,
MuseGlimmer's)."""
LEADING: Final[dict[str, str]] = {"llama3_json": "<|python_tag|>"}
"""The parsers whose calls are the whole text, after an optional marker: JSON objects
``{"name", "parameters"}`` separated by ``;`` (a text that begins otherwise is free)."""

Part = tuple[str, str]
"""A piece of a call as written: ``("marker", text)`` (a special token, or text where the
tokenizer has none), ``("text", text)``, ``("regex", pattern)``, or ``("args", "")``
(the arguments' JSON)."""
_ARGS: Final[Part] = ("args", "")
SECTIONS: Final[dict[str, tuple[str, str, Callable[[str], list[Part]]]]] = {
    "deepseek_v31": (DS[0], DS[1], lambda name: [
        ("marker", DS[2]), ("text", name), ("marker", DS[4]), _ARGS, ("marker", DS[3])]),
    "deepseek_v3": (DS[0], DS[1], lambda name: [
        ("marker", DS[2]), ("text", "function"), ("marker", DS[4]),
        ("text", f"{name}\n```json\n"), _ARGS, ("text", "\n```"), ("marker", DS[3])]),
    "kimi_k2": (KIMI[0], KIMI[1], lambda name: [
        ("marker", KIMI[2]), ("text", f"functions.{name}:"), ("regex", "[0-9]{1,6}"),
        ("marker", KIMI[4]), _ARGS, ("marker", KIMI[3])]),
}  # fmt: skip
"""The parsers whose calls are blocks in a section: the section's markers, and how a call
of a function is written."""


@dataclass(frozen=True, slots=True)
class Tagged:
    """A format whose calls write each parameter in tags (``{}``: a name)."""

    opening: str
    closing: str
    """The block's (or section's) markers."""
    several: bool
    """A block holds several calls."""
    fn_open: str
    fn_close: str
    param_open: str
    param_close: str
    key: str = '[^>\\n"]{1,128}'
    """A parameter's name, as a regex (another function's: any)."""
    before: tuple[Part, ...] = ()
    after: tuple[Part, ...] = ()
    """What a call writes before ``fn_open`` and after ``fn_close`` (in a section)."""
    json_open: str = ""
    """A parameter's opening tag where its value is JSON, not text ("": ``param_open``)."""
    sep: str = ""
    """What may come before a parameter (FunctionGemma's ``,``; "": nothing)."""


_QWEN3: Final = Tagged("<tool_call>", "</tool_call>", False, "<function={}>", "</function>",
                       "<parameter={}>", "</parameter>")  # fmt: skip
TYPED: Final[dict[str, Tagged]] = {
    "qwen3_coder": _QWEN3,
    "mimo": _QWEN3,  # (its values read as strings, whatever the schema: vLLM's)
    "seed_oss": Tagged("<seed:tool_call>", "</seed:tool_call>", False,
                       "<function={}>", "</function>", "<parameter={}>", "</parameter>"),
    "minimax_m2": Tagged("<minimax:tool_call>", "</minimax:tool_call>", True, '<invoke name="{}">',
                         "</invoke>", '<parameter name="{}">', "</parameter>"),
    "glm45": Tagged("<tool_call>", "</tool_call>", False, "{}\n", "",
                    "<arg_key>{}</arg_key>\n<arg_value>", "</arg_value>", "[^<\\n]{1,128}"),
    "step3": Tagged(STEP[0], STEP[1], True, '<steptml:invoke name="{}">', "</steptml:invoke>",
                    '<steptml:parameter name="{}">', "</steptml:parameter>",
                    before=(("marker", STEP[2]), ("text", "function"), ("marker", STEP[4])),
                    after=(("marker", STEP[3]),)),
    "deepseek_v32": Tagged(V32[0], V32[1], True, V32[2] + ' name="{}">', V32[3],
                           V32[4] + ' name="{}" string="true">', V32[5],
                           json_open=V32[4] + ' name="{}" string="false">'),
    "hy_v3": Tagged("<tool_calls>", "</tool_calls>", True, "<tool_call>{}<tool_sep>",
                    "</tool_call>", "<arg_key>{}</arg_key><arg_value>", "</arg_value>",
                    "[^<\\n]{1,128}"),
    "dots": Tagged("<dots_function_call>", "</dots_function_call>", True, '<invoke name="{}">',
                   "</invoke>", '<parameter name="{}">', "</parameter>"),
    "solar_open2": Tagged(SOLAR[0], SOLAR[1], False, "{}\n", "", SOLAR[2] + "{}" + SOLAR[3],
                          SOLAR[4], "[^<\\n]{1,128}"),
    "deepseek_v4": Tagged(V4[0], V4[1], True, V32[2] + ' name="{}">', V32[3],
                          V32[4] + ' name="{}" string="true">', V32[5],
                          json_open=V32[4] + ' name="{}" string="false">'),
    "functiongemma": Tagged(GEMMA[0], GEMMA[1], False, "call:{}{{", "}", "{}:" + GEMMA[2],
                            GEMMA[2], "[A-Za-z0-9_]{1,128}", sep=","),
    "minicpm5": Tagged("<function", "</function>", False, 'name="{}">', "",
                       '<param name="{}">', "</param>"),
}  # fmt: skip
"""The parsers whose calls write each parameter in tags. A string parameter's value is
its text; another's is JSON its schema allows."""


def grammar(
    parser: str,
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str | None:
    """The grammar for a text with calls of ``functions`` (each a name, its parameters'
    JSON Schema, and whether it is strict) in ``parser``'s format; ``parallel`` false:
    one call at most; ``token``: how the grammar names a marker the tokenizer makes a
    special token (None: it is text).
    None: the format is not built."""
    if not functions:
        return None
    if parser in LEADING:
        return _leading(LEADING[parser], _body(functions, "parameters"), parallel, token)
    if parser in SECTIONS:
        return _sections(*SECTIONS[parser], functions, parallel, token)
    if parser in TYPED:
        return _typed(TYPED[parser], functions, parallel, token)
    if parser == "mistral":
        return _mistral(functions, parallel, token)
    if parser == "pythonic":
        return strict_python.grammar(functions, parallel, token)
    if parser == "xlam":
        return _xlam(functions, parallel, token)
    if parser == "olmo3":
        return _olmo3(functions, parallel, token)
    if parser == "lfm2":
        return _lfm2(functions, parallel, token)
    if parser == "gemma4":
        return _gemma4(functions, parallel, token)
    if parser == "gigachat3" and token("<|function_call|>") is None:
        return _gigachat3(functions, parallel, token)
    markers = BLOCKS.get(parser)
    if markers is None:
        return None
    opening, closing, shape, key = markers
    body = _body(functions, key)
    if shape == "array":
        most = {} if parallel else {"maxItems": 1}
        item = {k: v for k, v in body.items() if k != "x-guidance"}
        body = {"type": "array", "minItems": 1, **most, "items": item, "x-guidance": _WS}
    more = {"several": " (WS? body)*", "items": ' (WS? "," WS? body)*'}.get(shape, "")
    calls = f"WS? body{more if parallel else ''} WS?"
    return _around(opening, closing, calls, [f"body: %json {json.dumps(body)}"],
                   parallel, token)  # fmt: skip


def _sections(
    opening: str,
    closing: str,
    call: Callable[[str], list[Part]],
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str:
    """A text with sections of calls, each written as ``call`` writes it."""
    rules = ["entry: " + " | ".join(f"entry_{k}" for k in range(len(functions)))]
    for k, (name, params, strict) in enumerate(functions):
        schema = {**(params if strict and params else {"type": "object"}), "x-guidance": _WS}
        parts = [f"args_{k}" if kind == "args" else _part(kind, value, token)
                 for kind, value in call(name)]  # fmt: skip
        rules += [f"entry_{k}: {' '.join(parts)}", f"args_{k}: %json {json.dumps(schema)}"]
    body = "WS? entry (WS? entry)* WS?" if parallel else "WS? entry WS?"
    return _around(opening, closing, body, rules, parallel, token)


def _typed(
    f: Tagged,
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str:
    """A text with blocks of calls whose parameters are tagged: a strict function's
    parameters are its properties, each at most once and in the schema's order (as
    llguidance writes a JSON object's), the ``required`` ones always; a string's value is
    its text up to the closing tag (only an ``enum`` held), another's JSON its schema
    allows; another function's are any names, their values text."""
    text_value = "/(.|\\n)*" + re.escape(f.param_close).replace("/", "\\/") + "/"
    sep = f"{json.dumps(f.sep)}?" if f.sep else ""
    rules = ["entry: " + " | ".join(f"fn_{k}" for k in range(len(functions))),
             f"value[lazy]: {text_value}"]  # fmt: skip
    for k, (name, params, strict) in enumerate(functions):
        props = (params or {}).get("properties") if strict else None
        head = " ".join([*(_part(*p, token) for p in f.before), json.dumps(f.fn_open.format(name))])
        tail = " ".join([json.dumps(f.fn_close)] * bool(f.fn_close) +
                        [_part(*p, token) for p in f.after])  # fmt: skip
        if not strict:
            prefix, suffix = (json.dumps(p) for p in f.param_open.split("{}", 1))
            if f.json_open:  # either tag, its value text
                suffix = f"({suffix} | {json.dumps(f.json_open.split('{}', 1)[1])})"
            rules += [f"fn_{k}: {head} WS? (param_{k} WS?)* {tail}",
                      f"param_{k}: " + " ".join(p for p in (sep, prefix, f"/{f.key}/", suffix,
                                                             "value") if p.strip('" '))]  # fmt: skip
            continue
        props = props if isinstance(props, dict) else {}
        names = list(props)
        if not names:
            rules.append(f"fn_{k}: {head} WS? {tail}")
            continue
        needed = (params or {}).get("required")
        needed = set(needed) if isinstance(needed, list) else set()
        written = " ".join(f"param_{k}_{j} WS?" if key in needed else f"(param_{k}_{j} WS?)?"
                           for j, key in enumerate(names))  # fmt: skip
        rules.append(f"fn_{k}: {head} WS? {written} {tail}")
        for j, key in enumerate(names):
            value, is_json = _value(props[key], f.param_close)
            opened = f.json_open if is_json and f.json_open else f.param_open
            rules.append(f"param_{k}_{j}: {sep} {json.dumps(opened.format(key))} {value}")
    body = "WS? entry (WS? entry)* WS?" if f.several and parallel else "WS? entry WS?"
    return _around(f.opening, f.closing, body, rules, parallel, token)


def _value(schema: Any, close: str) -> tuple[str, bool]:
    """A tagged parameter's value and closing tag, as its ``schema`` allows, and whether
    the value is JSON (else text)."""
    if not isinstance(schema, dict):
        return "value", False  # read as written
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), None)
    enum = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        options = " | ".join(json.dumps(e) for e in enum)  # strings, written bare
        return f'"\\n"? ({options}) "\\n"? {json.dumps(close)}', False
    if kind == "string" or (kind is None and enum is None):
        return "value", False  # text (a schema without a type: read as written)
    sub = {**schema, "x-guidance": _WS}
    return f"WS? %json {json.dumps(sub)} WS? {json.dumps(close)}", True


def _mistral(
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str:
    """Mistral's calls after ``[TOOL_CALLS]``: ``NAME[ARGS]{...}`` each where the
    tokenizer has an ``[ARGS]`` token (v11 and later), else a JSON array of ``{"name",
    "arguments"}`` (after the text ``[TOOL_CALLS]`` too, where it is not a token)."""
    if token("[ARGS]") is None:
        body = _body(functions, "arguments")
        most = {} if parallel else {"maxItems": 1}
        item = {k: v for k, v in body.items() if k != "x-guidance"}
        array = {"type": "array", "minItems": 1, **most, "items": item, "x-guidance": _WS}
        return _around("[TOOL_CALLS]", "", "WS? body WS?",
                       [f"body: %json {json.dumps(array)}"], parallel, token)  # fmt: skip
    rules = ["entry: " + " | ".join(f"entry_{k}" for k in range(len(functions)))]
    for k, (name, params, strict) in enumerate(functions):
        schema = {**(params if strict and params else {"type": "object"}), "x-guidance": _WS}
        rules += [f"entry_{k}: {json.dumps(name)} {token('[ARGS]')} args_{k}",
                  f"args_{k}: %json {json.dumps(schema)}"]  # fmt: skip
    return _around("[TOOL_CALLS]", "", "entry", rules, parallel, token)


def _gigachat3(
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str:
    """GigaChat 3's calls, each a JSON object after ``function call<|role_sep|>`` (and
    ``<|message_sep|>`` before it, perhaps). Where ``<|role_sep|>`` is a token, the text
    writes it only after ``function call``, so prose that says "function call" stays
    free; where it is text, the header is a lazy marker."""
    rules = [f"body: %json {json.dumps(_body(functions, 'arguments'))}"]
    sep = token("<|role_sep|>")
    if sep is None:
        return _around("function call<|role_sep|>", "", "WS? body WS?", rules, parallel, token)
    msg = token("<|message_sep|>")
    head = "HEAD" if msg is None else f'(HEAD | TEXT {msg} WS? "function call")'
    return "\n".join([
        "%llguidance {}",
        "start: call* TEXT" if parallel else "start: TEXT | call TEXT",
        r"TEXT: /(.|\n)*/",
        r"HEAD: /(.|\n)*function call/",
        f"call: {head} {sep} WS? body WS?",
        r"WS: /[ \t\r\n]+/",
        *rules,
    ])  # fmt: skip


def _gemma4(
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str:
    """Gemma 4's calls, ``call:NAME{KEY:VALUE,...}`` in a block each: a strict function's
    parameters its properties, in the schema's order, the ``required`` ones always; a
    string (an enum's strings held) between ``<|"|>`` delimiters, an integer, number,
    boolean or null ``%json`` (bare, as Gemma writes them), another value (an object, an
    array) any of Gemma's values, its schema not held; another function's pairs any."""
    quote = _part("marker", GEMMA4[2], token)
    if quote == json.dumps(GEMMA4[2]):  # text: a string ends where the quote is written
        ended = re.escape(GEMMA4[2]).replace("/", "\\/")
        strings = [f"g4str: {quote} g4text", f"g4text[lazy]: /(.|\\n)*{ended}/"]
    else:  # a token, which a string's text cannot write
        strings = [f"g4str: {quote} G4TEXT {quote}", r"G4TEXT: /(.|\n)*/"]
    rules = ["entry: " + " | ".join(f"fn_{k}" for k in range(len(functions))), *strings,
             'g4value: g4str | "{" (g4pair ("," g4pair)*)? "}" | "[" (g4value ("," g4value)*)? "]" | G4BARE',
             'g4pair: G4KEY ":" g4value', r"G4KEY: /[A-Za-z0-9_]{1,128}/",
             r"G4BARE: /-?[0-9]{1,32}(\.[0-9]{1,32})?|true|false|null/"]  # fmt: skip
    for k, (name, params, strict) in enumerate(functions):
        head = json.dumps(f"call:{name}{{")
        if not strict:
            rules.append(f'fn_{k}: {head} (g4pair ("," g4pair)*)? "}}"')
            continue
        props = (params or {}).get("properties")
        props = props if isinstance(props, dict) else {}
        names = list(props)
        needed = (params or {}).get("required")
        needed = set(needed) if isinstance(needed, list) else set()
        optional = [key not in needed for key in names]
        m = len(names)

        def ref(rule: str, j: int, optional: list[bool] = optional, m: int = m, k: int = k) -> str:
            """Rule ``rule`` from parameter ``j`` on (nothing past the last; ``?`` where
            all of them are optional)."""
            return "" if j == m else f"{rule}_{k}_{j}" + "?" * all(optional[j:])

        for j, key in enumerate(names):
            rules.append(f"p_{k}_{j}: {json.dumps(key + ':')} {_gemma4_value(props[key], quote)}")
            skip = optional[j] and j + 1 < m  # (where it is left out, the next begins)
            first = [f"p_{k}_{j} {ref('r', j + 1)}"] + [f"s_{k}_{j + 1}"] * skip
            then = [f'"," p_{k}_{j} {ref("r", j + 1)}'] + [f"r_{k}_{j + 1}"] * skip
            rules += [f"s_{k}_{j}: {' | '.join(first)}", f"r_{k}_{j}: {' | '.join(then)}"]
        rules.append(f'fn_{k}: {head} {ref("s", 0)} "}}"')
    return _around(GEMMA4[0], GEMMA4[1], "entry", rules, parallel, token)


def _gemma4_value(schema: Any, quote: str) -> str:
    """A strict Gemma 4 parameter's value, as its ``schema`` allows (see :func:`_gemma4`)."""
    if not isinstance(schema, dict):
        return "g4value"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), None)
    enum = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return f"{quote} ({' | '.join(json.dumps(e) for e in enum)}) {quote}"
    if kind == "string":
        return "g4str"
    if kind in ("integer", "number", "boolean", "null"):
        return f"%json {json.dumps({**schema, 'x-guidance': _WS})}"
    return "g4value"


def _olmo3(
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str | None:
    """OLMo 3's calls: one ``<function_calls>`` block (the parser reads the first), a
    Python call a line (:func:`.strict_python.call_rules`). None: no function has a
    Python name."""
    more = r" (/[ \t]*\n\s*/ pycall)*" if parallel else ""
    block = (python_calls.OPEN, python_calls.CLOSE)
    return _python_block(block, f"WS? pycall{more} WS?", functions, token)


def _lfm2(
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str | None:
    """LFM2's calls: one ``<|tool_call_start|>`` block (the parser reads the first), a
    Python list of calls (:func:`.strict_python.call_rules`). None: no function has a
    Python name."""
    more = ' ("," " "? pycall)*' if parallel else ""
    block = (python_calls.LFM2_START, python_calls.LFM2_END)
    return _python_block(block, f'WS? "[" pycall{more} "]" WS?', functions, token)


def _python_block(
    block: tuple[str, str],
    body: str,
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    token: Callable[[str], str | None],
) -> str | None:
    """Python calls (``body``, of ``pycall`` rules) in one ``block`` (its markers: the
    parsers read the first). None: no function has a Python name."""
    rules = strict_python.call_rules(functions)
    if rules is None:
        return None
    return _around(*block, body, rules, False, token)


_FENCE: Final = r"```(json)?\s*\["
"""Where a fenced ``xlam`` array begins (its ``[``: a fence of other code stays free)."""


def _xlam(
    functions: Sequence[tuple[str, dict[str, Any] | None, bool]],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str:
    """xLAM's calls: a text that begins with ``[`` is a JSON array of calls; one that
    begins otherwise is free, but where it writes a fence and ``[``, ``<tool_call>`` or
    ``[TOOL_CALLS]``, an array of calls follows (to the fence's end, or
    ``</tool_call>``)."""
    item = _body(functions, "arguments")
    most = {} if parallel else {"maxItems": 1}
    array = {"type": "array", "minItems": 1, **most, "x-guidance": _WS,
             "items": {k: v for k, v in item.items() if k != "x-guidance"}}  # fmt: skip
    more = ' (WS? "," WS? item)*' if parallel else ""
    rules = [f'fenced: WS? item{more} WS? "]" WS? "```"',
             f"tagged: WS? body WS? {_part('marker', '</tool_call>', token)}",
             "marked: WS? body", f"body: %json {json.dumps(array)}",
             f"item: %json {json.dumps(item)}"]  # fmt: skip
    triggers = [_FENCE]
    for rule, marker in (("tagged", "<tool_call>"), ("marked", "[TOOL_CALLS]")):
        ref = token(marker)
        if ref is None:
            triggers.append(re.escape(marker))
        for head, text in (("first", "FIRST"), ("call", "TEXT")):
            if ref is not None:
                rules.append(f"{head}_{rule}: {text} {ref}")
            else:  # (a leading text's whitespace is WS's: one lexeme ends where it may)
                text = "LEAD" if (head, rule) == ("first", "marked") else text
                rules.append(f"{head}_{rule}[lazy]: {text} {json.dumps(marker)}")
    for head, text in (("first", "FIRST"), ("call", "TEXT")):
        ws = "WS? " if head == "first" and token("[TOOL_CALLS]") is None else ""
        rules += [f"{head}_fenced[lazy]: {text} /{_FENCE}/",
                  f"{head}: {head}_fenced fenced | {head}_tagged tagged | {ws}{head}_marked marked"]  # fmt: skip
    any_trigger = "|".join(triggers).replace("/", "\\/")
    tail = "call* TEXT" if parallel else f"TAIL\nTAIL: /(?s:.*)/ & ~/(?s:.*)({any_trigger})(?s:.*)/"
    return "\n".join([
        "%llguidance {}",
        f"start: WS? body WS? | FIRST | first {tail}",
        r"TEXT: /(.|\n)*/",
        r"FIRST: /\s*([^\s\[](.|\n)*)?/",
        r"LEAD: /([^\s\[](.|\n)*)?/",
        r"WS: /[ \t\r\n]+/",
        *rules,
    ])  # fmt: skip


def _part(kind: str, value: str, token: Callable[[str], str | None]) -> str:
    if kind == "marker" and (ref := token(value)) is not None:
        return ref
    return f"/{value}/" if kind == "regex" else json.dumps(value)


def _around(
    opening: str,
    closing: str,
    body: str,
    rules: list[str],
    parallel: bool,
    token: Callable[[str], str | None],
) -> str:
    """Free text with calls (``body``, its ``rules``) between ``opening`` and
    ``closing`` ("": none)."""
    if (ref := token(opening)) is not None:
        head, text = f"call_head: TEXT {ref}", r"/(.|\n)*/"
    else:  # the text after the one call may not write another's marker
        head = f"call_head[lazy]: TEXT {json.dumps(opening)}"
        text = r"/(.|\n)*/" if parallel else _without(opening)
    close = "" if not closing else _part("marker", closing, token)
    return "\n".join([
        "%llguidance {}",
        "start: call* TEXT" if parallel else "start: TEXT | call TAIL",
        r"TEXT: /(.|\n)*/",
        f"TAIL: {text}",
        head,
        f"call: call_head {body} {close}".rstrip(),
        r"WS: /[ \t\r\n]+/",
        *rules,
    ])  # fmt: skip


_WS: Final = {"whitespace_pattern": "[ ]?"}
"""Whitespace between a call's JSON tokens: none or one space, as models write calls on
one line (``{"name": "f", "arguments": {"a": 1}}``); a random or drifting model is not
left to write whitespace forever."""


def _body(functions: Sequence[tuple[str, dict[str, Any] | None, bool]], key: str) -> dict[str, Any]:
    """One call's JSON Schema: ``{"name": ..., key: ...}`` of one of ``functions`` ("":
    ``{NAME: ...}``)."""
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
        if key
        else {
            "type": "object",
            "properties": {name: params if strict and params else {"type": "object"}},
            "required": [name],
            "additionalProperties": False,
        }
        for name, params, strict in functions
    ]
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _WS}


def _leading(marker: str, body: dict[str, Any], parallel: bool,
             token: Callable[[str], str | None]) -> str:  # fmt: skip
    """A text that is calls (after ``marker``, or from its first ``{``), or free text
    that begins otherwise."""
    ref = token(marker)
    mark, first = (ref, "{") if ref is not None else (json.dumps(marker), "{<")
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
