"""A parameter's JSON Schema read as vLLM's MiniMax-M3 parser reads it (its ``_llm_nom``
grammar's ``FunctionCallParameterDataType``): the kinds a value may be (its
*candidates*), the schemas of an object's properties and an array's items, and a text
converted by them.

A schema's candidates are its ``type`` (a name or a list; ``str``, ``int``, ``list``,
``dict`` and the like read as JSON Schema's), else ``object`` where it has
``properties`` (or ``additionalProperties``), ``array`` where it has ``items`` (or
``prefixItems``), its ``const``'s or ``enum``'s kinds, its ``anyOf``/``oneOf``/``allOf``
choices', and ``string`` where it tells none. A text is converted by each candidate
(``null`` for ``none``; an integer; a number, an integer where it is one; a boolean,
``yes``/``on``/``1`` and ``no``/``off``/``0`` too; JSON for the others), the most
confident reading winning, a reading the schema allows above any other (validated
against the whole schema with ``jsonschema``, as vLLM's: ``minimum``, ``pattern``,
``required``... count too; a schema that is itself invalid allows none above another); an
empty text is ``{}``, ``[]``, null or ``""`` as the candidates allow.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Final

from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for

_NAMES: Final = {
    "none": "null", "nil": "null", "null": "null", "str": "string", "string": "string",
    "text": "string", "int": "integer", "integer": "integer", "float": "number",
    "number": "number", "bool": "boolean", "boolean": "boolean", "array": "array",
    "list": "array", "object": "object", "dict": "object", "dictionary": "object",
    "map": "object",
}  # fmt: skip
"""A ``type`` name's kind (another name: ``other``, read as JSON)."""
_CHOICES: Final = ("anyOf", "oneOf", "allOf")


def kind_of(value: Any) -> str:
    """The kind of a JSON value (an example's: ``const``, ``enum``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else "other"


def candidates(schema: Any) -> list[str]:
    """The kinds a value of ``schema`` may be, in the schema's order, each once."""
    out: list[str] = []
    for kind in _kinds(schema):
        if kind not in out:
            out.append(kind)
    return out


def _kinds(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return ["string"]
    if "type" in schema:
        t = schema["type"]
        names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        if names is None:
            return ["other"]
        return [_NAMES.get(n.lower(), "other") if isinstance(n, str) else "string" for n in names]
    props = schema.get("additionalProperties", False)
    if isinstance(schema.get("properties"), dict) or ("additionalProperties" in schema
                                                      and props is not False):  # fmt: skip
        return ["object"]
    if "items" in schema or "prefixItems" in schema:
        return ["array"]
    if "const" in schema:
        return [kind_of(schema["const"])]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return [kind_of(v) for v in schema["enum"]]
    found = [k for f in _CHOICES if isinstance(schema.get(f), list)
             for choice in schema[f] for k in _kinds(choice)]  # fmt: skip
    return found or ["string"]


@dataclass(frozen=True, slots=True)
class DataType:
    """A value's schema (None: none known) and its candidates."""

    schema: Any
    kinds: tuple[str, ...]

    @classmethod
    def of(cls, schema: Any) -> DataType:
        return cls(schema, tuple(candidates(schema)))

    def property(self, key: str) -> DataType | None:
        """The schema of an object's member ``key`` (None: none)."""
        return self._sub(lambda s: _property(s, key))

    def item(self, index: int) -> DataType | None:
        """The schema of an array's item at ``index`` (None: none)."""
        return self._sub(lambda s: _item(s, index))

    def _sub(self, find: Any) -> DataType | None:
        if not isinstance(self.schema, dict):
            return None
        got = find(self.schema)
        if got:
            return DataType.of(got)
        options = [g for f in _CHOICES if isinstance(self.schema.get(f), list)
                   for c in self.schema[f] if isinstance(c, dict) and (g := find(c))]  # fmt: skip
        return DataType.of({"anyOf": options}) if options else None

    def convert(self, text: str) -> Any:
        """``text`` read as the schema's value (see the module docstring)."""
        if not text:
            for kind, empty in (("object", {}), ("array", []), ("null", None)):
                if kind in self.kinds:
                    return empty
            return ""
        readings: list[tuple[int, Any]] = []
        for kind in self.kinds:
            got = _reading(kind, text)
            if got is not None:
                score, value = got
                readings.append((score + (10 if self._allows(value) else 0), value))
        if not readings:
            return text
        return max(readings, key=lambda r: r[0])[1]  # the first of the most confident

    def _allows(self, value: Any) -> bool:
        return bool(self.schema) and allows(self.schema, value)


def _property(schema: dict[str, Any], key: str) -> Any:
    props = schema.get("properties")
    if isinstance(props, dict) and props.get(key):
        return props[key]
    more = schema.get("additionalProperties")
    return more if isinstance(more, dict) else None


def _item(schema: dict[str, Any], index: int) -> Any:
    if schema.get("items"):
        return schema["items"]
    prefix = schema.get("prefixItems")
    if not isinstance(prefix, list):
        return None
    if index < len(prefix):
        return prefix[index]
    return schema.get("additionalItems") or (prefix[-1] if prefix else None)


def _reading(kind: str, text: str) -> tuple[int, Any] | None:
    """A text read as ``kind``: its confidence and value (None: it is not one)."""
    stripped = text.strip()
    if kind == "null":
        if not stripped:
            return 3, None
        return (10 if stripped.lower() == "null" else 1), None
    if kind == "string":
        return 2, text
    if kind == "integer":
        try:
            return 10, int(text)
        except ValueError:
            return None
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return None
        if math.isnan(number):
            return 10, "NaN"
        if math.isinf(number):
            return 10, "Infinity" if number > 0 else "-Infinity"
        return 10, int(number) if number.is_integer() else number
    if kind == "boolean":
        flag = stripped.lower()
        if len(stripped) <= 5 and flag in ("true", "false"):
            return 10, flag == "true"
        if len(stripped) <= 5 and flag in ("yes", "on", "1", "no", "off", "0"):
            return 9, flag in ("yes", "on", "1")
        return 1, False
    try:
        return 10, json.loads(text)
    except (ValueError, RecursionError):
        return None


def allows(schema: Any, value: Any) -> bool:
    """Whether ``value`` is valid against ``schema`` (``jsonschema.validate``'s draft: the
    schema's ``$schema``, else 2020-12; formats not asserted). False where the schema is
    invalid or cannot be checked (an unresolvable ``$ref``), as vLLM's reading counts it."""
    try:
        validator = _validator(json.dumps(schema, sort_keys=True))
        return validator is not None and validator.is_valid(value)
    except Exception:  # vLLM's reading: whatever fails is not valid
        return False


@functools.lru_cache(maxsize=512)
def _validator(schema: str) -> Validator | None:
    """A validator of a schema (its JSON text, a cache key); None: the schema is invalid."""
    loaded = json.loads(schema)
    cls = validator_for(loaded)
    try:
        cls.check_schema(loaded)
    except SchemaError:
        return None
    return cls(loaded)
