"""The bounds a fleet sets on what it decodes: one :class:`Limits` (a worker's config may
set it), checked by workers on every entry read from Redis and by producers before sending."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .inputs import InputLimits


class Limits(BaseModel):
    """Bounds applied to everything decoded from Redis (and checked again by producers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_entry_bytes: int = Field(1_048_576, ge=256, le=64 * 1_048_576)
    max_inputs: int = Field(64, ge=1, le=4096)
    max_text_chars: int = Field(20_000, ge=1, le=1_000_000)
    max_metadata_items: int = Field(16, ge=0, le=256)
    max_metadata_chars: int = Field(256, ge=1, le=65_536)
    max_result_ttl_s: int = Field(7 * 24 * 3600, ge=1)
    max_messages: int = Field(256, ge=1, le=4096)
    """Chat messages in one generation request."""
    max_new_tokens: int = Field(4096, ge=1, le=1_000_000)
    """The most tokens a generation request may ask for (a model's config may lower it)."""
    max_stop: int = Field(8, ge=0, le=64)
    """Stop strings in one generation request (each at most 256 chars)."""
    inputs: InputLimits = Field(default_factory=InputLimits)
    """Images and rankings (schemas/inputs.py)."""


DEFAULT_LIMITS = Limits()
