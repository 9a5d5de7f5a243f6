"""Values coerced to their JSON Schema's types as vLLM's ``coerce_to_schema_type`` does,
and a call's arguments as its parser engine's ``_fix_arg_types`` does (``inkling``).

A text is read as the first of its schema's types it can be, in the order null, integer,
number, boolean, object, array, string (aliases such as ``int``, ``float``, ``bool``,
``list``, ``dict`` read as JSON Schema's): ``null`` (any case), an integer, a finite
number (an integer where it is one), ``true``/``1`` or ``false``/``0`` (any case), an
object's or array's JSON; a string as it is; none of these: JSON, else as written.
Arguments are coerced member by member where the function's schema has the member: a
string as above, an object's members by its ``properties``, an array's items by its
``items``, any other value as its JSON text is (so ``5`` becomes ``"5"`` where the schema
says a string, as vLLM's does).
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

from .json_compact import Pairs

_ALIASES: Final = {
    "str": "string", "text": "string", "varchar": "string", "char": "string",
    "enum": "string", "int": "integer", "int32": "integer", "int64": "integer",
    "uint": "integer", "uint32": "integer", "uint64": "integer", "long": "integer",
    "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
    "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
    "arr": "array", "list": "array", "sequence": "array",
}  # fmt: skip
_ORDER: Final = ("null", "integer", "number", "boolean", "object", "array", "string")
_KINDS: Final = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"),
                 (str, "string"), (list, "array"), (dict, "object"))  # fmt: skip


def types_of(schema: Any) -> list[str]:
    """The types a schema allows (vLLM's ``extract_types_from_schema``): its ``type``,
    its ``enum``'s values' kinds, its choices' (``anyOf``, ``oneOf``, ``allOf``); none
    told: ``string``."""
    if not isinstance(schema, dict):
        return ["string"]
    found: set[str] = set()
    t = schema.get("type")
    found.update([t] if isinstance(t, str) else [n for n in t if isinstance(n, str)]
                 if isinstance(t, list) else [])  # fmt: skip
    if isinstance(schema.get("enum"), list):
        found.update(next(k for cls, k in _KINDS if isinstance(v, cls)) for v in schema["enum"]
                     if isinstance(v, type(None) | bool | int | float | str | list | dict))  # fmt: skip
    for choice in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(choice), list):
            for sub in schema[choice]:
                found.update(types_of(sub))
    return sorted(found) or ["string"]


def coerce(value: str, types: list[str]) -> Any:
    """``value`` read as the first of ``types`` it can be (see the module docstring)."""
    allowed = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _ORDER:
        if kind not in allowed:
            continue
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind in ("object", "array") and (got := _finite_json(value)) is not None:
            return got[0]
    got = _finite_json(value)
    return value if got is None else got[0]


def coerce_args(args: dict[str, Any], props: dict[str, Any]) -> Pairs:
    """A call's arguments, each member the function's schema has (``props``, its
    ``properties``) coerced by it (vLLM's engine's ``_coerce_dict``); written as they
    were (:class:`.json_compact.Pairs`: each member in its place)."""
    pairs = args.pairs if isinstance(args, Pairs) else list(args.items())
    return Pairs([(k, _value(v, props[k]) if isinstance(props.get(k), dict) else v)
                  for k, v in pairs])  # fmt: skip


def _value(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, str):
        return coerce(value, types_of(schema))
    if isinstance(value, dict):
        props = schema.get("properties")
        return coerce_args(value, props) if isinstance(props, dict) else value
    if isinstance(value, list):
        items = schema.get("items")
        return [_value(v, items) for v in value] if isinstance(items, dict) else value
    got = coerce(json.dumps(value, ensure_ascii=False), types_of(schema))
    return got if type(got) is not type(value) or got != value else value


def _finite_json(value: str) -> tuple[Any] | None:
    """``value`` read as JSON with finite numbers only (None: it is not)."""
    try:
        got = json.loads(value)
        json.dumps(got, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None
    return (got,)
