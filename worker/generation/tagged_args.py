"""The parameters of the tool-call formats that write each one in tags, typed by the
function's JSON Schema (``qwen3_coder``, ``seed_oss``, ``glm45``, ``minimax_m2``,
``step3``, ``deepseek_v32``; vLLM's): a string stays as written, a number, boolean, object or array is read
as JSON (then as a Python literal), ``null`` is null; a value that is not what its schema
says stays as written. :mod:`.tools` reads the blocks, :mod:`.tool_chunks` streams each
parameter once its closing tag is written.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any, Final

from ...schemas.tools import Tool
from .json_compact import Pairs

Types = dict[str, dict[str, str]]
"""Each function's parameters' types (``param_types``)."""


def param_types(tools: list[Tool]) -> Types:
    """Each function's parameters' types, as its JSON Schema gives them (the first of a
    list other than ``null``; none: written as is)."""
    out: Types = {}
    for tool in tools:
        props = (tool.function.parameters or {}).get("properties")
        kinds: dict[str, str] = {}
        for key, schema in (props if isinstance(props, dict) else {}).items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(kind, list):
                kind = next((k for k in kind if isinstance(k, str) and k != "null"), None)
            if isinstance(kind, str):
                kinds[key] = kind
        out[tool.function.name] = kinds
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


TYPED_ARGS: Final[dict[str, TypedArgs]] = {
    "qwen3_coder": qwen3_coder_args, "seed_oss": qwen3_coder_args, "glm45": glm45_args,
    "minimax_m2": minimax_m2_args, "step3": step3_args, "deepseek_v32": deepseek_v32_args,
}  # fmt: skip
"""Each typed format's parameters, as its blocks write them."""
