"""Constraints on the generated text: vLLM's ``structured_outputs`` (a JSON schema, a regex,
choices, a grammar, a structural tag) and OpenAI's ``response_format``, which maps onto
them; each bounded in size, as a grammar's compile time grows with it."""

from __future__ import annotations

import json as _json
from typing import Annotated, Any, Final, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from .wire import _Strict

MAX_GRAMMAR_CHARS: Final = 65_536
"""The longest ``structured_outputs`` constraint: a JSON schema (as JSON text), a regex or
a grammar."""
MAX_CHOICES: Final = 1_024
"""The most strings a ``structured_outputs.choice`` lists."""
MAX_STRUCTURES: Final = 128
"""The most structures (and triggers) a ``structural_tag`` lists."""

_ALIASED = ConfigDict(
    extra="forbid", frozen=True, strict=True, validate_by_alias=True, validate_by_name=True,
    serialize_by_alias=True,
)  # fmt: skip


class TagStructure(_Strict):
    """One structure of a :class:`StructuralTag`: ``begin``, JSON valid under ``schema``,
    ``end``."""

    model_config = _ALIASED
    begin: str = Field(min_length=1, max_length=1024)
    """Its opening text; it begins with one of the tag's ``triggers``."""
    json_schema: dict[str, Any] = Field(alias="schema")
    """``schema``: the JSON Schema its JSON is valid under."""
    end: str = Field("", max_length=1024)


class StructuralTag(_Strict):
    """vLLM's structural tag (``structures`` and ``triggers``): the text is free, but where
    it writes a trigger, one of the structures that begin with it follows (its ``begin``,
    JSON valid under its schema, its ``end``), then free text again. Tool calls in a
    model's own format, held mid-text."""

    model_config = _ALIASED
    type: Literal["structural_tag"] = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1, max_length=MAX_STRUCTURES)
    triggers: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        min_length=1, max_length=MAX_STRUCTURES
    )

    @model_validator(mode="after")
    def _triggered(self) -> StructuralTag:
        for s in self.structures:
            if not any(s.begin.startswith(t) for t in self.triggers):
                raise ValueError(f"structural_tag: the structure beginning {s.begin!r} begins "
                                 "with none of its triggers")  # fmt: skip
        size = len(self.model_dump_json(by_alias=True))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"too_large: structural_tag has {size} chars as JSON "
                             f"> {MAX_GRAMMAR_CHARS}")  # fmt: skip
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: the generated text follows one constraint (exactly one
    of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``, ``structural_tag``)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, validate_by_alias=True, validate_by_name=True,
        serialize_by_alias=True,
    )  # fmt: skip
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    """``json``: a JSON Schema (an object, or its JSON text); the text is JSON valid under it."""
    json_object: bool | None = None
    """True: the text is a JSON object (any)."""
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    """The text matches this regular expression (Rust ``regex`` syntax, whole text)."""
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    """The text is exactly one of these strings."""
    grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    """The text derives from this context-free grammar: Lark syntax (llguidance's) or GBNF
    (llama.cpp's)."""
    disable_any_whitespace: bool | None = None
    """JSON: no whitespace between tokens (compact JSON); default: any whitespace."""
    disable_additional_properties: bool | None = None
    """JSON: objects hold only the properties their schema lists (as if every object in it
    said ``additionalProperties: false`` where it says nothing)."""
    whitespace_pattern: str | None = Field(None, min_length=1, max_length=256)
    """JSON: the regex whitespace between tokens matches (instead of any whitespace)."""
    structural_tag: StructuralTag | None = None
    """Free text that holds structures where it writes their triggers (vLLM's: an object,
    or its JSON text)."""

    @field_validator("structural_tag", mode="before")
    @classmethod
    def _tag_text(cls, v: Any) -> Any:
        """vLLM's form: the tag as JSON text."""
        if isinstance(v, str):
            if len(v) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"too_large: structural_tag has {len(v)} chars "
                                 f"> {MAX_GRAMMAR_CHARS}")  # fmt: skip
            try:
                return _json.loads(v)
            except ValueError as exc:
                raise ValueError(f"structural_tag: not JSON ({exc})") from None
        return v

    @property
    def kind(self) -> str:
        """Which constraint it sets."""
        return self.set_kinds()[0]

    def set_kinds(self) -> list[str]:
        """The constraint fields it sets (``json_object`` only when true)."""
        kinds = []
        if self.json_schema is not None:
            kinds.append("json")
        if self.json_object:
            kinds.append("json_object")
        kinds += [k for k in ("regex", "choice", "grammar", "structural_tag")
                  if getattr(self, k) is not None]  # fmt: skip
        return kinds

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        kinds = self.set_kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs sets exactly one of json, json_object, regex, "
                             f"choice, grammar, structural_tag (it sets {kinds or 'none'})")  # fmt: skip
        if isinstance(self.json_schema, dict):
            size = len(_json.dumps(self.json_schema, separators=(",", ":"), default=str))
        else:
            size = len(self.json_schema or "")
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"too_large: structured_outputs.json has {size} chars as JSON "
                             f"> {MAX_GRAMMAR_CHARS}")  # fmt: skip
        if self.choice is not None:
            chars = sum(len(c) for c in self.choice)
            if chars > MAX_GRAMMAR_CHARS or not all(self.choice):
                raise ValueError(f"structured_outputs.choice: non-empty strings, at most "
                                 f"{MAX_GRAMMAR_CHARS} chars in all")  # fmt: skip
        return self


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, validate_by_alias=True, validate_by_name=True,
        serialize_by_alias=True,
    )  # fmt: skip
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    json_schema: dict[str, Any] = Field(alias="schema")
    """``schema``: the JSON Schema the text is valid under."""
    strict: bool | None = None
    """Accepted (OpenAI's); the text always follows the schema."""


class ResponseFormat(_Strict):
    """OpenAI's ``response_format`` (``text``, ``json_object`` or ``json_schema``), and
    vLLM's ``structural_tag`` (with ``structures`` and ``triggers``): the same constraints
    as :class:`StructuredOutputs`' ``json_object``, ``json`` and ``structural_tag``."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: type json_schema comes with json_schema "
                             "(and only it)")  # fmt: skip
        tagged = self.structures is not None and self.triggers is not None
        if (self.type == "structural_tag") != tagged or (
            not tagged and (self.structures or self.triggers) is not None
        ):
            raise ValueError("response_format: type structural_tag comes with structures "
                             "and triggers (and only it)")  # fmt: skip
        if tagged:
            self._tag()  # checked now
        if self.json_schema is not None:
            size = len(
                _json.dumps(self.json_schema.json_schema, separators=(",", ":"), default=str)
            )
            if size > MAX_GRAMMAR_CHARS:
                raise ValueError(f"too_large: response_format.json_schema.schema has {size} "
                                 f"chars as JSON > {MAX_GRAMMAR_CHARS}")  # fmt: skip
        return self

    def structured(self) -> StructuredOutputs | None:
        """The constraint it asks for (None: ``text``, none)."""
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputs.model_validate({"json": self.json_schema.json_schema})
        if self.type == "structural_tag":
            return StructuredOutputs(structural_tag=self._tag())
        return None

    def _tag(self) -> StructuralTag:
        return StructuralTag.model_validate(
            {"structures": self.structures, "triggers": self.triggers}
        )
