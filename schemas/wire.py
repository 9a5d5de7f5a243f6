"""The base classes of the wire models: a request part is validated strictly; a result
part, decoded from the wire, ignores the fields it does not know."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

FROM_WIRE = "from_wire"
"""Validation-context flag of :func:`batchfleet.schemas.codec.decode_result`: read a result as
a tolerant reader (unknown fields ignored, unknown ``status`` and ``error.code`` kept)."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Answer(_Wire):
    """A part of a result. Built in Python it is checked like any wire model; decoded with
    the ``FROM_WIRE`` context it ignores fields it does not know, so that a worker of a later
    v1 release can add optional fields without breaking deployed clients (issue #12)."""

    @model_validator(mode="before")
    @classmethod
    def _ignore_unknown_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict):
            fields = cls.__pydantic_fields__  # not model_fields: a property, slower per call
            if data.keys() <= fields.keys() or not cls._from_wire(info):
                return data  # the usual: nothing to drop (a delta per streamed token)
            return {k: v for k, v in data.items() if k in fields}
        return data

    @staticmethod
    def _from_wire(info: ValidationInfo) -> bool:
        return bool((info.context or {}).get(FROM_WIRE))


class _Strict(_Wire):
    """A request part: validated strictly, so a wrong type is ``invalid_request`` rather than
    coerced (``"deadline_ms": "60000"``, ``true`` for an int, ``5.0`` for an int: issue #15)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
