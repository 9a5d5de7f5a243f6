"""Standard Webhooks signatures (https://www.standardwebhooks.com), via ``standardwebhooks``.

A delivery carries ``webhook-id`` (stable across retries: the receiver's idempotency key),
``webhook-timestamp`` (unix seconds of this attempt) and ``webhook-signature``
(``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body`` under the ``whsec_`` secret).

Receivers verify with one call::

    from batchfleet.webhooks.signing import verify
    result = verify(secret, request_body_bytes, request_headers)  # raises on a bad signature
"""

from __future__ import annotations

import base64
import hmac
import json
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import msgpack
from standardwebhooks.webhooks import Webhook, WebhookVerificationError, hmac_data

TOLERANCE_S = 300
"""A delivery whose timestamp is further than this from now is refused (replay window)."""

__all__ = ["TOLERANCE_S", "WebhookVerificationError", "headers", "sign", "verify"]


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value of ``body`` sent as ``msg_id`` at ``timestamp``.

    Text bodies go through the library's ``Webhook.sign``; msgpack bodies (not UTF-8) use its
    ``hmac_data`` over the same ``id.timestamp.body`` bytes, as the spec defines it.
    """
    webhook = Webhook(secret)  # parses and checks the whsec_ secret
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        digest = hmac_data(_key(secret), f"{msg_id}.{timestamp}.".encode() + body)
        return "v1," + base64.b64encode(digest).decode()
    signature: str = webhook.sign(msg_id, datetime.fromtimestamp(timestamp, tz=timezone.utc), text)
    return signature


def headers(secret: str, msg_id: str, body: bytes, *, now: float | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt (a fresh timestamp each time)."""
    timestamp = int(time.time() if now is None else now)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


def verify(
    secret: str, body: bytes | str, request_headers: Mapping[str, str], *, now: float | None = None
) -> Any:
    """Check a received delivery and return its decoded payload (JSON or msgpack).

    Raises ``WebhookVerificationError`` when a header is missing, the timestamp is more than
    :data:`TOLERANCE_S` away from now, or no ``v1`` signature matches.
    """
    data = body.encode() if isinstance(body, str) else bytes(body)
    found = {k.lower(): v for k, v in request_headers.items()}
    msg_id = found.get("webhook-id")
    stamp = found.get("webhook-timestamp")
    signatures = found.get("webhook-signature")
    if not (msg_id and stamp and signatures):
        raise WebhookVerificationError("Missing required headers")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError("Invalid Signature Headers") from None
    if abs((time.time() if now is None else now) - timestamp) > TOLERANCE_S:
        raise WebhookVerificationError("Message timestamp too old or too new")
    expected = sign(secret, msg_id, timestamp, data).split(",", 1)[1]
    if not any(
        version == "v1" and hmac.compare_digest(sig, expected)
        for version, _, sig in (part.partition(",") for part in signatures.split(" "))
    ):
        raise WebhookVerificationError("No matching signature found")
    if data[:1] in (b"{", b"["):
        return json.loads(data)
    return msgpack.unpackb(data, raw=False)


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix("whsec_") + "==")
