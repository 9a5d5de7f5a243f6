"""Where a request's webhook delivery stands, for the submitter to poll.

The stored result never changes once written, so the delivery's progress lives in its own key,
``bf:{<model>}:webhook:<id>`` (JSON, with the result's TTL), written by webhooks workers after
each attempt. No key: no attempt has finished yet (queued, or waiting for a slot of a busy
endpoint), or the request had no webhook.
"""

from __future__ import annotations

from typing import Literal

import redis
from pydantic import BaseModel, ConfigDict

from ..connection import SyncClient
from ..schemas.keys import ModelKeys

State = Literal["scheduled", "delivered", "failed", "refused", "disabled"]
"""``scheduled``: an attempt failed, the next is due at ``next_attempt_ms``. ``delivered``: a
2xx came back. ``failed``: gave up (attempts exhausted, a 4xx, no secret, result expired).
``refused``: the URL is not allowed (scheme, SSRF policy); never contacted. ``disabled``: the
endpoint answered 410 Gone, now or earlier. The last three are final, until a redelivery."""


class WebhookStatus(BaseModel):
    """The value of ``bf:{<model>}:webhook:<id>``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: State
    webhook_id: str
    url: str
    attempts: int
    """Attempts made so far (an HTTP request, or a check that refused the URL)."""
    reason: str
    """What the last attempt got, e.g. ``HTTP 503`` or ``refused: ... (private)``."""
    http_status: int | None = None
    next_attempt_ms: int | None = None
    """Unix ms of the next attempt (``scheduled`` only)."""
    dead_letter_id: str | None = None
    """Entry of ``bf:webhooks:failed`` to ``redeliver`` (final states only)."""
    updated_ms: int


def write(
    client: SyncClient, model: str, request_id: str, status: WebhookStatus, ttl_s: int
) -> None:
    client.set(ModelKeys(model).webhook_status(request_id), status.model_dump_json(), ex=ttl_s)


def webhook_status(client: redis.Redis, model: str, request_id: str) -> WebhookStatus | None:
    """The delivery status of ``request_id``'s webhook, or None (see the module docstring)."""
    return parse_status(client.get(ModelKeys(model).webhook_status(request_id)))


def parse_status(raw: object) -> WebhookStatus | None:
    """The value of a webhook-status key as read (None when there is none)."""
    if raw is None:
        return None
    if not isinstance(raw, (bytes, str)):
        raise TypeError(f"a webhook status is a JSON string, got {type(raw).__name__}")
    return WebhookStatus.model_validate_json(raw)
