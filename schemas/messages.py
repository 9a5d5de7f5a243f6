"""Pydantic models of every message on the wire: requests, results, and their parts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .errors import ErrorCode
from .keys import MODEL_NAME, REQUEST_ID

SCHEMA_VERSION = 1
Format = Literal["msgpack", "json"]
Status = Literal["ok", "error", "expired"]


class Limits(BaseModel):
    """Bounds applied to everything decoded from Redis (and checked again by producers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_entry_bytes: int = Field(1_048_576, ge=256, le=64 * 1_048_576)
    max_inputs: int = Field(64, ge=1, le=4096)
    max_text_chars: int = Field(20_000, ge=1, le=1_000_000)
    max_metadata_items: int = Field(16, ge=0, le=256)
    max_metadata_chars: int = Field(256, ge=1, le=65_536)
    max_result_ttl_s: int = Field(7 * 24 * 3600, ge=1)


DEFAULT_LIMITS = Limits()


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SECRET_ID = r"^[A-Za-z0-9_.-]{1,64}$"


class Webhook(_Wire):
    """Where to POST a request's result. Secrets live in the fleet file, never in a request."""

    url: str = Field(min_length=8, max_length=2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\s]+$")
    """``https://`` (``http://`` only where the fleet allows it); checked again on delivery."""
    secret_id: str | None = Field(None, pattern=SECRET_ID)
    """Which configured secret signs the delivery; default: the fleet's."""
    format: Format | None = None
    """Body encoding; default ``json``."""


class Request(_Wire):
    """One inference request: the map stored in a lane stream entry."""

    v: Literal[1] = SCHEMA_VERSION
    id: str = Field(pattern=REQUEST_ID.pattern)
    model: str = Field(pattern=MODEL_NAME.pattern)
    inputs: list[str] = Field(min_length=1)
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

    @model_validator(mode="after")
    def _within_limits(self, info: ValidationInfo) -> Request:
        limits: Limits = (info.context or {}).get("limits", DEFAULT_LIMITS)
        if len(self.inputs) > limits.max_inputs:
            raise ValueError(
                f"too_large: {len(self.inputs)} inputs > max_inputs {limits.max_inputs}"
            )
        for i, text in enumerate(self.inputs):
            if not text.strip():
                raise ValueError(f"empty_input: inputs[{i}] is empty")
            if len(text) > limits.max_text_chars:
                raise ValueError(
                    f"too_large: inputs[{i}] has {len(text)} chars > max_text_chars "
                    f"{limits.max_text_chars}"
                )
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


class ErrorInfo(_Wire):
    code: ErrorCode
    message: str

    @field_validator("message")
    @classmethod
    def _short(cls, v: str) -> str:
        return v if len(v) <= 1000 else v[:997] + "..."


class Timings(_Wire):
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


class Result(_Wire):
    """The final answer to one request: stored at its result key and published."""

    v: Literal[1] = SCHEMA_VERSION
    id: str
    model: str
    status: Status
    outputs: list[Any] | None = None
    """One output per input (``ok`` only): an embedding list or a classification map."""
    truncated: list[bool] | None = None
    """Per input: was it cut to the model's max tokens?"""
    error: ErrorInfo | None = None
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, str] = Field(default_factory=dict)
    finished_at_ms: int = 0
    """Unix ms (Redis clock) when the result was written."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"
