"""Pydantic models of every message on the wire: requests, results, and their parts."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .errors import ErrorCode
from .inputs import Input, InputLimits, check_inputs
from .keys import MODEL_NAME, REQUEST_ID

SCHEMA_VERSION: Final = 1
Format = Literal["msgpack", "json"]
Status = Literal["ok", "error", "expired"]
"""The statuses workers of this version write. Readers must accept others (see
docs/protocol.md, "What may change within v1"): a decoded ``Result.status`` is any string."""
OK: Final = "ok"
ERROR: Final = "error"
EXPIRED: Final = "expired"
KNOWN_STATUSES: Final = frozenset({OK, ERROR, EXPIRED})

FROM_WIRE = "from_wire"
"""Validation-context flag of :func:`batchfleet.schemas.codec.decode_result`: read a result as
a tolerant reader (unknown fields ignored, unknown ``status`` and ``error.code`` kept)."""


class Limits(BaseModel):
    """Bounds applied to everything decoded from Redis (and checked again by producers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_entry_bytes: int = Field(1_048_576, ge=256, le=64 * 1_048_576)
    max_inputs: int = Field(64, ge=1, le=4096)
    max_text_chars: int = Field(20_000, ge=1, le=1_000_000)
    max_metadata_items: int = Field(16, ge=0, le=256)
    max_metadata_chars: int = Field(256, ge=1, le=65_536)
    max_result_ttl_s: int = Field(7 * 24 * 3600, ge=1)
    inputs: InputLimits = Field(default_factory=InputLimits)
    """Images and rankings (schemas/inputs.py)."""


DEFAULT_LIMITS = Limits()


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Answer(_Wire):
    """A part of a result. Built in Python it is checked like any wire model; decoded with
    the ``FROM_WIRE`` context it ignores fields it does not know, so that a worker of a later
    v1 release can add optional fields without breaking deployed clients (issue #12)."""

    @model_validator(mode="before")
    @classmethod
    def _ignore_unknown_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and cls._from_wire(info):
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data

    @staticmethod
    def _from_wire(info: ValidationInfo) -> bool:
        return bool((info.context or {}).get(FROM_WIRE))


SECRET_ID = r"^[A-Za-z0-9_.-]{1,64}$"


class _Strict(_Wire):
    """A request part: validated strictly, so a wrong type is ``invalid_request`` rather than
    coerced (``"deadline_ms": "60000"``, ``true`` for an int, ``5.0`` for an int: issue #15)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Webhook(_Strict):
    """Where to POST a request's result. Secrets live in the fleet file, never in a request."""

    url: str = Field(min_length=8, max_length=2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\s]+$")
    """``https://`` (``http://`` only where the fleet allows it); checked again on delivery."""
    secret_id: str | None = Field(None, pattern=SECRET_ID)
    """Which configured secret signs the delivery; default: the fleet's."""
    format: Format | None = None
    """Body encoding; default ``json``."""


class Request(_Strict):
    """One inference request: the map stored in a lane stream entry."""

    v: Literal[1] = SCHEMA_VERSION
    id: str = Field(pattern=REQUEST_ID.pattern)
    model: str = Field(pattern=MODEL_NAME.pattern)
    inputs: list[Input] = Field(min_length=1)
    """Texts, or other kinds of input (schemas/inputs.py): text pairs, rankings, images."""
    deadline_ms: int | None = Field(None, ge=1, le=7 * 24 * 3600 * 1000)
    """Result due this many ms after the entry was added (its stream id's time)."""
    reply: str | None = Field(None, min_length=1, max_length=256)
    """Pub/sub channel the result is also PUBLISHed to."""
    result_ttl_s: int | None = Field(None, ge=1)
    format: Format | None = None
    """Encoding of the result; default: the encoding the request came in."""
    metadata: dict[str, str] = Field(default_factory=dict)
    """Opaque strings echoed back in the result."""
    webhook: Webhook | None = None
    """POST the result there too (signed, retried); it stays pollable either way."""

    @field_validator("v", mode="before")
    @classmethod
    def _int_version(cls, v: Any) -> Any:
        # Literal[1] alone would also take true and 1.0
        if type(v) is not int:
            raise ValueError(f"v must be the integer 1, got {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> Request:
        limits: Limits = (info.context or {}).get("limits", DEFAULT_LIMITS)
        if len(self.inputs) > limits.max_inputs:
            raise ValueError(
                f"too_large: {len(self.inputs)} inputs > max_inputs {limits.max_inputs}"
            )
        check_inputs(self.inputs, self.model, limits.max_text_chars, limits.inputs)
        if len(self.metadata) > limits.max_metadata_items:
            raise ValueError(f"too_large: metadata has more than {limits.max_metadata_items} items")
        for k, val in self.metadata.items():
            if len(k) > limits.max_metadata_chars or len(val) > limits.max_metadata_chars:
                raise ValueError(
                    f"too_large: metadata entries are limited to {limits.max_metadata_chars} chars"
                )
        if self.result_ttl_s is not None and self.result_ttl_s > limits.max_result_ttl_s:
            raise ValueError(f"too_large: result_ttl_s > {limits.max_result_ttl_s}")
        return self


class ErrorInfo(_Answer):
    """Why a request was not answered ``ok``: a stable ``code`` and a human-readable message."""

    code: ErrorCode | str
    """An :class:`ErrorCode` when this client knows it; a decoded result keeps an unknown code
    as its string (new codes may appear within v1)."""
    message: str

    @field_validator("code", mode="before")
    @classmethod
    def _known_code(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str) and not isinstance(v, ErrorCode):
            if v in ErrorCode._value2member_map_:
                return ErrorCode(v)
            if not cls._from_wire(info):
                raise ValueError(f"unknown error code {v!r}")
        return v

    @field_validator("message")
    @classmethod
    def _short(cls, v: str) -> str:
        return v if len(v) <= 1000 else v[:997] + "..."


class Timings(_Answer):
    """Where a request's time went (milliseconds, Redis server clock)."""

    queued_ms: float = 0.0
    """Enqueue → read by a worker."""
    batch_wait_ms: float = 0.0
    """Read → its batch was dispatched."""
    inference_ms: float = 0.0
    """Its batch's run time on the device."""
    total_ms: float = 0.0
    """Enqueue → result written."""
    batch_size: int = 0
    """Rows in its batch."""
    batch_id: str = ""
    worker: str = ""


class Result(_Answer):
    """The final answer to one request: stored at its result key and published.

    Workers build it with a known :data:`Status`; clients decode it with
    :func:`~batchfleet.schemas.codec.decode_result`, which keeps any ``status`` string: a
    status this client does not know is a final, non-``ok`` answer.
    """

    v: Literal[1] = SCHEMA_VERSION
    id: str
    model: str
    status: str
    """``ok``, ``error``, ``expired`` (:data:`OK`, :data:`ERROR`, :data:`EXPIRED`), or, decoded
    from a later v1 worker, a status this client does not know."""
    outputs: list[Any] | None = None
    """One output per input (``ok`` only): an embedding list or a classification map."""
    truncated: list[bool] | None = None
    """Per input: was it cut to the model's max tokens?"""
    error: ErrorInfo | None = None
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, str] = Field(default_factory=dict)
    finished_at_ms: int = 0
    """Unix ms (Redis clock) when the result was written."""

    @field_validator("status")
    @classmethod
    def _known_status(cls, v: str, info: ValidationInfo) -> str:
        if v not in KNOWN_STATUSES and not cls._from_wire(info):
            raise ValueError(f"status must be one of {sorted(KNOWN_STATUSES)}, got {v!r}")
        return v

    @property
    def ok(self) -> bool:
        """True for status ``ok`` only (never for a status this client does not know)."""
        return self.status == OK
