"""Failed deliveries: records in the stream ``bf:webhooks:failed``, listed and replayed by
``batchfleet webhooks list-failed`` and ``batchfleet webhooks redeliver``.

A record keeps the exact body that was sent, so a redelivery works after the result's TTL
and carries the same ``webhook-id`` (the receiver's idempotency key). A successful
redelivery deletes its record; a failed one replaces it with a new record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..connection import SyncClient
from ..schemas.keys import WEBHOOK_QUEUE, WebhookKeys
from . import endpoints

if TYPE_CHECKING:
    from celery import Celery

    from .config import WebhooksConfig
    from .tasks import Delivery

KEYS = WebhookKeys()


@dataclass(frozen=True, slots=True)
class FailedDelivery:
    """One dead-letter record."""

    id: str
    delivery: dict[str, Any]
    reason: str
    status: int | None
    attempts: int
    failed_at_ms: int
    body: bytes

    def summary(self) -> dict[str, Any]:
        """What ``list-failed`` prints (no body)."""
        return {
            "id": self.id,
            "webhook_id": self.delivery.get("webhook_id"),
            "model": self.delivery.get("model"),
            "request_id": self.delivery.get("request_id"),
            "url": self.delivery.get("url"),
            "reason": self.reason,
            "status": self.status,
            "attempts": self.attempts,
            "failed_at_ms": self.failed_at_ms,
        }


def record(
    client: SyncClient,
    cfg: WebhooksConfig,
    delivery: Delivery,
    body: bytes,
    reason: str,
    status: int | None,
    attempts: int,
) -> str:
    """Add a record for a delivery that gave up (replacing the one it was redelivering)."""
    fields: dict[str, Any] = {
        "delivery": delivery.model_copy(update={"redelivery_of": None}).model_dump_json(),
        "reason": reason[:1000],
        "status": "" if status is None else str(status),
        "attempts": str(attempts),
        "failed_at_ms": str(int(time.time() * 1000)),
        "body": body,
    }
    pipe = client.pipeline(transaction=True)
    pipe.xadd(KEYS.failed, fields, maxlen=cfg.failed_maxlen, approximate=True)  # type: ignore[arg-type]
    if delivery.redelivery_of is not None:
        pipe.xdel(KEYS.failed, delivery.redelivery_of)
    new_id = pipe.execute()[0]
    return new_id.decode() if isinstance(new_id, bytes) else str(new_id)


def _parse(entry_id: bytes | str, fields: dict[bytes, bytes]) -> FailedDelivery:
    status = fields.get(b"status", b"")
    return FailedDelivery(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        delivery=json.loads(fields[b"delivery"]),
        reason=fields.get(b"reason", b"").decode(errors="replace"),
        status=int(status) if status else None,
        attempts=int(fields.get(b"attempts", b"0")),
        failed_at_ms=int(fields.get(b"failed_at_ms", b"0")),
        body=fields.get(b"body", b""),
    )


def get(client: SyncClient, record_id: str) -> FailedDelivery | None:
    found: Any = client.xrange(KEYS.failed, record_id, record_id)
    return _parse(*found[0]) if found else None


def remove(client: SyncClient, record_id: str) -> None:
    client.xdel(KEYS.failed, record_id)


def list_failed(client: SyncClient, *, count: int = 100) -> Iterator[FailedDelivery]:
    """Records, oldest first, at most ``count``."""
    found: Any = client.xrange(KEYS.failed, count=count)
    for entry_id, fields in found:
        yield _parse(entry_id, fields)


def redeliver(
    client: SyncClient, app: Celery, record_ids: list[str] | None = None, *, count: int = 100
) -> list[str]:
    """Queue a fresh delivery (attempts start again) for each record, or for the oldest
    ``count`` when no ids are given. Re-enables their URLs, including one disabled because
    it answered 410 Gone. Returns the ids queued."""
    from .tasks import TASK_NAME

    if record_ids:
        records = [r for rid in record_ids if (r := get(client, rid)) is not None]
    else:
        records = list(list_failed(client, count=count))
    for rec in records:
        kwargs = dict(rec.delivery, redelivery_of=rec.id, first_attempt_ms=None)
        endpoints.enable(client, [kwargs["url"]])
        app.send_task(TASK_NAME, kwargs=kwargs, queue=WEBHOOK_QUEUE)
    return [rec.id for rec in records]
