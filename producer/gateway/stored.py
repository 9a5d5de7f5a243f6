"""Stored Responses API responses (``store``, OpenAI's default): each response the gateway
answered, with the conversation it continues, as JSON in Redis with a TTL, so that any
gateway continues it (``previous_response_id``) or reads it (``GET /v1/responses/{id}``).

What is stored is readable by whoever holds the gateway's API key and the response's id
(as vLLM's store is): the ids the gateway makes are random (uuid4).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...connection import AsyncClient
from ...schemas.keys import RESPONSE_ID, response_key

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 24 * 3600
MAX_TTL_S = 30 * 24 * 3600
"""OpenAI keeps stored responses 30 days: no longer here."""
DEFAULT_MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored response and the input items it was built from (its previous ones'
    included: the whole conversation before its output)."""

    response: dict[str, Any]
    input: list[dict[str, Any]]
    pending: dict[str, Any] | None = None
    """A background response not settled yet: what finishing it takes (``background.py``)."""
    replay: dict[str, Any] | None = None
    """A background response's: what rebuilding its events takes (the same as ``pending``),
    kept once it is final, so that it can be streamed again (``background_events.py``)."""

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one (``previous_response_id``) continues from:
        its input, then its output but its reasoning items, which vLLM leaves out of the
        next turn (``construct_input_messages``: "We skip the reasoning output").
        Its function calls stay: vLLM drops them too (vllm-project/vllm#43244, a bug: the
        next turn's ``function_call_output`` would answer a call the prompt lacks)."""
        output = self.response.get("output", [])
        return [*self.input, *(item for item in output if item.get("type") != "reasoning")]


class ResponseStore:
    """Get, put and delete stored responses (one key each: ``bf:responses:<id>``).
    ``ttl_s`` 0 stores nothing."""

    def __init__(
        self, client: AsyncClient, ttl_s: int = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if not 0 <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"a stored response's TTL is 0 (none stored) to {MAX_TTL_S} s")
        if max_bytes < 1:
            raise ValueError("a stored response's size bound must be at least 1 byte")
        self.client = client
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    async def put(
        self,
        response: Mapping[str, Any],
        input: list[dict[str, Any]],
        pending: Mapping[str, Any] | None = None,
        *,
        replay: Mapping[str, Any] | None = None,
        again: bool = False,
    ) -> bool:
        """Store ``response`` (built from ``input``; ``pending``: a background response's
        finishing, ``replay``: its events' rebuilding) for ``ttl_s``; False where it was not
        (storing is off, it is over ``max_bytes``: logged). ``again``: over a stored one,
        its TTL kept (False where it is gone: expired or deleted)."""
        if not self.enabled:
            return False
        record = {"response": response, "input": input}
        if pending is not None:
            record["pending"] = pending
        if replay is not None:
            record["replay"] = replay
        raw = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        if len(raw) > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, over the %d bytes bound",
                           response["id"], len(raw), self.max_bytes)  # fmt: skip
            return False
        if again:
            return bool(await self.client.set(response_key(response["id"]), raw, xx=True,
                                              keepttl=True))  # fmt: skip
        await self.client.set(response_key(response["id"]), raw, ex=self.ttl_s)
        return True

    async def get(self, response_id: str) -> Stored | None:
        """The stored response ``response_id`` (None: never stored, expired or deleted)."""
        if not RESPONSE_ID.match(response_id):
            return None
        raw = await self.client.get(response_key(response_id))
        if raw is None:
            return None
        record = json.loads(raw)
        return Stored(record["response"], record["input"], record.get("pending"),
                      record.get("replay"))  # fmt: skip

    async def delete(self, response_id: str) -> bool:
        """Delete ``response_id``; False where none was stored."""
        if not RESPONSE_ID.match(response_id):
            return False
        return bool(await self.client.delete(response_key(response_id)))
