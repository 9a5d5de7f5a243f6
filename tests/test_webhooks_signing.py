"""Standard Webhooks signatures: ours against the spec's reference algorithm and library."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import msgpack
import pytest
from batchfleet.webhooks.signing import WebhookVerificationError, headers, verify
from standardwebhooks import Webhook

# The secret of the spec's own example (standardwebhooks.com, "Signature scheme").
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
BODY = b'{"type":"inference.result","data":{"id":"req-1","status":"ok"}}'


def reference_signature(secret: str, msg_id: str, timestamp: str, body: bytes) -> str:
    """The spec's algorithm written out: HMAC-SHA256(base64-decoded secret, id.timestamp.body)."""
    key = base64.b64decode(secret.split("_", 1)[1])
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def test_signature_matches_the_spec_reference_and_the_library_verifies_it() -> None:
    sent = headers(SECRET, "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", BODY)
    assert sent["webhook-id"] == "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
    assert abs(int(sent["webhook-timestamp"]) - time.time()) < 5
    expected = reference_signature(SECRET, sent["webhook-id"], sent["webhook-timestamp"], BODY)
    assert sent["webhook-signature"] == expected
    # The maintained library's receiver check, and our one-call helper, both accept it.
    assert Webhook(SECRET).verify(BODY.decode(), sent) == json.loads(BODY)
    assert verify(SECRET, BODY, sent) == json.loads(BODY)


def test_msgpack_bodies_are_signed_over_their_raw_bytes() -> None:
    body = msgpack.packb({"data": {"outputs": [[0.5, -1.25]]}, "blob": "\xff"})
    assert b"\xff" in body or b"\xc3\xbf" in body
    sent = headers(SECRET, "msg_1", body)
    assert sent["webhook-signature"] == reference_signature(
        SECRET, "msg_1", sent["webhook-timestamp"], body
    )
    assert verify(SECRET, body, sent)["data"]["outputs"] == [[0.5, -1.25]]


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda b, h: (b.replace(b"ok", b"no"), h), id="tampered-body"),
        pytest.param(lambda b, h: (b, {**h, "webhook-id": "msg_other"}), id="other-id"),
        pytest.param(lambda b, h: (b, {**h, "webhook-signature": "v2,xyz"}), id="other-version"),
        pytest.param(
            lambda b, h: (b, {k: v for k, v in h.items() if k != "webhook-id"}), id="no-id"
        ),
    ],
)
def test_tampered_deliveries_fail(tamper) -> None:  # type: ignore[no-untyped-def]
    body, sent = tamper(BODY, headers(SECRET, "msg_1", BODY))
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, body, sent)
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(body.decode(), sent)


def test_a_stale_timestamp_fails_even_with_a_valid_signature() -> None:
    stale = headers(SECRET, "msg_1", BODY, now=time.time() - 600)
    assert stale["webhook-signature"] == reference_signature(
        SECRET, "msg_1", stale["webhook-timestamp"], BODY
    )
    with pytest.raises(WebhookVerificationError, match="timestamp"):
        verify(SECRET, BODY, stale)
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(SECRET).verify(BODY.decode(), stale)


def test_a_wrong_secret_fails() -> None:
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    with pytest.raises(WebhookVerificationError):
        verify(other, BODY, headers(SECRET, "msg_1", BODY))
