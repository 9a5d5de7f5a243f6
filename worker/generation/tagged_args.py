"""The parameters of the tool-call formats that write each one in tags, typed by the
function's JSON Schema (``qwen3_coder``, ``seed_oss``, ``glm45``, ``minimax_m2``,
``step3``, ``deepseek_v32``; vLLM's): a string stays as written, a number, boolean, object or array is read
as JSON (then as a Python literal), ``null`` is null; a value that is not what its schema
says stays as written. ``hy_v3``, ``solar_open2`` and ``dots`` type their values by
vLLM's rules for each (:func:`_hy_v3`, :func:`_coerced`, :func:`_dots`); ``mimo``'s are
all strings, as written; ``minicpm5``'s strings as written, others loosely (:func:`_minicpm5`).
:mod:`.tool_blocks` reads the blocks, :mod:`.tool_chunks` streams each parameter once its
closing tag is written.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any, Final
from xml.sax.saxutils import unescape

from ...schemas.tools import Tool
from . import gemma4_args, minimax_m3, xtml
from .coerce import coerce
from .json_compact import Pairs


class Kinds(dict[str, str]):
    """One function's parameters' types (a parameter's name to its schema's ``type``),
    with the schema they come from, for the parsers that read more of it (nested values,
    ``required``)."""

    __slots__ = ("schema",)

    def __init__(self, kinds: dict[str, str] | None = None,
                 schema: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(kinds or {})
        self.schema: dict[str, Any] = schema or {}
        """The function's ``parameters`` JSON Schema (``{}``: none)."""


Types = dict[str, dict[str, str]]
"""Each function's parameters' types (``param_types``: each a :class:`Kinds`)."""


def properties(known: dict[str, str]) -> dict[str, Any]:
    """A function's parameters' schemas, where ``known`` (its :data:`Types` entry) carries
    them (``{}``: none)."""
    props = known.schema.get("properties") if isinstance(known, Kinds) else None
    return props if isinstance(props, dict) else {}


def param_types(tools: list[Tool]) -> Types:
    """Each function's parameters' types, as its JSON Schema gives them (the first of a
    list other than ``null``; none: written as is), with the schema (:class:`Kinds`)."""
    out: Types = {}
    for tool in tools:
        params = tool.function.parameters or {}
        props = params.get("properties")
        kinds: dict[str, str] = {}
        for key, schema in (props if isinstance(props, dict) else {}).items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(kind, list):
                kind = next((k for k in kind if isinstance(k, str) and k != "null"), None)
            if isinstance(kind, str):
                kinds[key] = kind
        out[tool.function.name] = Kinds(kinds, params)
    return out


def _typed(raw: str, kind: str | None) -> Any:
    """A parameter's value (raw text, one newline each side) as its schema's ``kind``
    says (None: a string; ``any``: any JSON value it reads as, else a string)."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if value.strip().lower() == "null":
        return None
    if kind in (None, "string"):
        return value
    for read in (json.loads, ast.literal_eval):
        try:
            got = read(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if kind == "boolean" and isinstance(got, bool):
            return got
        if kind == "integer" and isinstance(got, int) and not isinstance(got, bool):
            return got
        if kind == "number" and isinstance(got, int | float) and not isinstance(got, bool):
            return got
        if kind == "any" or (kind in ("object", "array") and isinstance(got, dict | list)):
            try:
                json.dumps(got, allow_nan=False)
            except (TypeError, ValueError):
                continue
            return got
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value  # not what its schema says: as written


TypedArgs = Callable[[str, int, dict[str, str]], Pairs]
"""A typed format's parameters written whole in a text from an offset, typed by the
function's schema."""

_PARAMETER = re.compile(r"<parameter=([^>\n]{1,128})>(.*?)</parameter>", re.DOTALL)


def qwen3_coder_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The parameters written whole in ``text`` from ``at``, typed by ``known``."""
    return Pairs([(k.strip(), _typed(v, known.get(k.strip())))
                  for k, v in _PARAMETER.findall(text, at)])  # fmt: skip


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

_STEP3_PARAMETER = re.compile(r'<steptml:parameter name="([^"\n]{1,128})">(.*?)</steptml:parameter>',
                              re.DOTALL)  # fmt: skip

_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"\n]{1,128})">(.*?)</parameter>', re.DOTALL)


def minimax_m2_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The parameters written whole in ``text`` from ``at``, typed by ``known``."""
    return Pairs([(k.strip(), _typed(v, known.get(k.strip())))
                  for k, v in _MINIMAX_PARAMETER.findall(text, at)])  # fmt: skip


def glm45_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The arguments written whole in ``text`` from ``at``, typed by ``known`` (JSON
    unless a string)."""
    return Pairs([(k.strip(), _typed(v.strip(), known.get(k.strip()) or "any"))
                  for k, v in _GLM_ARG.findall(text, at)])  # fmt: skip


def step3_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The parameters written whole in ``text`` from ``at``, trimmed, typed by ``known``."""
    return Pairs([(k.strip(), _typed(v.strip(), known.get(k.strip())))
                  for k, v in _STEP3_PARAMETER.findall(text, at)])  # fmt: skip


_V32_PARAMETER = re.compile(r'<\uff5cDSML\uff5cparameter\s+name="([^"\n]{1,128})"\s+'
                            r'string="(true|false)"\s*>(.*?)</\uff5cDSML\uff5cparameter>',
                            re.DOTALL)  # fmt: skip


def deepseek_v32_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The parameters written whole in ``text`` from ``at``: a ``string="true"`` one's
    value as written, another's typed by ``known`` (JSON where it types none)."""
    return Pairs([(k, v if string == "true" else _typed(v, known.get(k) or "any"))
                  for k, string, v in _V32_PARAMETER.findall(text, at)])  # fmt: skip


def mimo_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The parameters written whole in ``text`` from ``at``, each a string as written
    (MiMo's, vLLM's: whatever the schema)."""
    return Pairs([(k.strip(), v) for k, v in _PARAMETER.findall(text, at)])


def _json_value(raw: str) -> tuple[bool, Any]:
    """Whether ``raw`` is a JSON value (finite numbers only), and the value."""
    try:
        value = json.loads(raw)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False, None
    return True, value


def _loose(value: str) -> Any:
    """A value read as JSON, else as a Python literal (JSON's kinds only), else as written."""
    ok, got = _json_value(value)
    if ok:
        return got
    try:
        got = ast.literal_eval(value)
        json.dumps(got, allow_nan=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return got


def hy_v3_value(value: str, kind: str | None) -> Any:
    """A value as vLLM's ``hy_v3`` reads it for its schema's ``kind`` (None: a string):
    ``true``/``false``, an integer, a number (an integer unless it has ``.`` or an
    exponent), an object's or array's JSON; what is none of these, as JSON or a Python
    literal, else as written."""
    if kind in (None, "string"):
        return value
    if kind == "boolean" and value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value) if any(c in value for c in ".eE") else int(value)
            if math.isfinite(number):
                return number
    except ValueError:
        pass
    return _loose(value)


def hy_v3_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The arguments written whole in ``text`` from ``at`` (``glm45``'s tags), each as
    written, typed by ``known`` as vLLM's ``hy_v3`` does."""
    return Pairs([(k, hy_v3_value(v, known.get(k))) for k, v in _GLM_ARG.findall(text, at)])


def _coerced(value: str, kind: str | None) -> Any:
    """A value as vLLM's ``coerce_to_schema_type`` reads it for its schema's ``kind``
    (None: a string; :func:`.coerce.coerce`)."""
    return coerce(value, [kind or "string"])


_SOLAR_ARG = re.compile(r"<\|tool_arg:start\|>(.*?)<\|tool_arg:value\|>(.*?)<\|tool_arg:end\|>",
                        re.DOTALL)  # fmt: skip


def solar_open2_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The arguments written whole in ``text`` from ``at``, each value as written, typed
    by ``known`` as vLLM's ``solar_open2`` does; a name written twice: its first."""
    seen: dict[str, Any] = {}
    for k, v in _SOLAR_ARG.findall(text, at):
        seen.setdefault(k, _coerced(v, known.get(k)))
    return Pairs(list(seen.items()))


def _dots(value: str, kind: str | None) -> Any:
    """A value as vLLM's ``dots`` reads it for its schema's ``kind`` (None: a string):
    ``null`` (any case) null; a string as written; an integer, a number (an integer where
    it is one; finite), a boolean (``true`` or ``1``, any case; else false), else JSON;
    a value not of its type as written."""
    if value.lower() == "null":
        return None
    if kind in (None, "string"):
        return value
    if kind == "boolean":
        return value.lower() in ("true", "1")
    try:
        if kind == "integer":
            return int(value)
        if kind == "number" and math.isfinite(number := float(value)):
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("integer", "number"):
        return value  # (not finite)
    ok, got = _json_value(value)
    return got if ok else value


_DOTS_PARAMETER = re.compile(r"""<parameter\s+name\s*=\s*["']?([^"'>\n]{1,128}?)["']?\s*>(.*?)</parameter>""",
                             re.DOTALL)  # fmt: skip


def dots_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The parameters written whole in ``text`` from ``at``, trimmed, typed by ``known``
    as vLLM's ``dots`` does."""
    return Pairs(
        [(k, _dots(v.strip(), known.get(k))) for k, v in _DOTS_PARAMETER.findall(text, at)]
    )


_MINICPM5_PARAM = re.compile(r"""<param\s+name=['"]([^'"\n]{1,128})['"]>(.*?)</param>""", re.DOTALL)
_MINICPM5_NAMELESS = re.compile(r"<param(?![^>]*\bname=)[^>]*>")
_CDATA = re.compile(r"\A<!\[CDATA\[(.*)\]\]>\Z", re.DOTALL)


def _minicpm5_text(raw: str) -> str:
    """A value's text: a CDATA section's as written, another's trimmed, its XML entities
    read."""
    cdata = _CDATA.match(raw)
    return cdata.group(1) if cdata else unescape(raw.strip(), {"&quot;": '"', "&apos;": "'"})


def _minicpm5(value: Any, kind: str | None) -> Any:
    """A value as vLLM's ``minicpm5`` reads it for its schema's ``kind``: a string as it
    is (another value, a wrapper's, as JSON text), another value JSON, else a Python
    literal, else as written."""
    if kind == "string":
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return _loose(value) if isinstance(value, str) else value


_WRAPPERS: Final = ("properties", "arguments")
"""The parameters MiniCPM5 may wrap the others in (OpenAI's names), as an object."""


def _minicpm5_read(text: str, at: int, known: dict[str, str]) -> tuple[list[tuple[str, Any]], bool]:
    """The ``<param name="KEY">`` values written whole in ``text`` from ``at`` as vLLM's
    ``minicpm5`` adds them, and whether they make a call: where the function's schema
    lists its parameters, one it lacks is left out, and a wrapper (``properties`` or
    ``arguments``, unless the schema has it) gives its object's members it has; none
    written twice, a wrapper that is no object of them none (read up to the first fault)."""
    props = properties(known)
    out: dict[str, Any] = {}
    for k, v in _MINICPM5_PARAM.findall(text, at):
        key = k.strip()
        if props and key not in props and key in _WRAPPERS:
            wrapped = _loose(_minicpm5_text(v))
            members = [(w, x) for w, x in (wrapped.items() if isinstance(wrapped, dict) else ())
                       if w in props]  # fmt: skip
            if not members or any(w in out for w, _ in members):
                return list(out.items()), False
            out.update((w, _minicpm5(x, known.get(w))) for w, x in members)
        elif not props or key in props:
            if key in out:
                return list(out.items()), False
            out[key] = _minicpm5(_minicpm5_text(v), known.get(key))
    return list(out.items()), True


def minicpm5_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The ``<param name="KEY">`` values written whole in ``text`` from ``at``, typed by
    ``known`` as vLLM's ``minicpm5`` does (:func:`_minicpm5_read`)."""
    return Pairs(_minicpm5_read(text, at, known)[0])


def minicpm5_sound(text: str, at: int, known: dict[str, str]) -> bool:
    """Whether a MiniCPM5 call's parameters from ``at`` make a call (vLLM's): none
    without its name, none of them at fault (:func:`_minicpm5_read`), the schema's
    ``required`` all given."""
    got, sound = _minicpm5_read(text, at, known)
    given = {k for k, _ in got}
    return sound and _MINICPM5_NAMELESS.search(text, at) is None and required(known) <= given


def required(known: dict[str, str]) -> set[str]:
    """The parameters a function's schema requires (its :data:`Types` entry's)."""
    names = known.schema.get("required") if isinstance(known, Kinds) else None
    return {r for r in names if isinstance(r, str)} if isinstance(names, list) else set()


def minimax_m3_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The parameters written whole in ``text`` from ``at`` (:mod:`.minimax_m3`), each
    read by its schema as vLLM's M3 grammar reads it."""
    return minimax_m3.args(text, at, known, properties(known))


_GEMMA_ARG = re.compile(r"(\w+):<escape>(.*?)<escape>", re.DOTALL)


def functiongemma_args(text: str, at: int, known: dict[str, str]) -> Pairs:
    """The arguments written whole in ``text`` from ``at`` (``KEY:<escape>VALUE<escape>``),
    each JSON, else a string, whatever the schema (vLLM's ``functiongemma``; a key written
    twice: its last value, in its first place)."""
    seen: dict[str, Any] = {}
    for k, v in _GEMMA_ARG.findall(text, at):
        ok, got = _json_value(v)
        seen[k] = got if ok else v
    return Pairs(list(seen.items()))


TYPED_ARGS: Final[dict[str, TypedArgs]] = {
    "qwen3_coder": qwen3_coder_args, "seed_oss": qwen3_coder_args, "glm45": glm45_args,
    "minimax_m2": minimax_m2_args, "step3": step3_args, "deepseek_v32": deepseek_v32_args,
    "mimo": mimo_args, "hy_v3": hy_v3_args, "solar_open2": solar_open2_args,
    "dots": dots_args,
    "deepseek_v4": deepseek_v32_args, "functiongemma": functiongemma_args,
    "gemma4": gemma4_args.settled, "minicpm5": minicpm5_args, "kimi_k3": xtml.args,
    "minimax_m3": minimax_m3_args,
}  # fmt: skip
"""Each typed format's parameters, as its blocks write them."""
