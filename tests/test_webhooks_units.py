"""Webhook delivery logic without I/O: status verdicts, backoff, which results are owed."""

from __future__ import annotations

import random

import pytest
from batchfleet.schemas.messages import Request, Result
from batchfleet.webhooks.config import WebhooksConfig
from batchfleet.webhooks.observer import deliveries
from batchfleet.webhooks.tasks import (
    backoff_s,
    busy_wait_s,
    classify,
    parse_retry_after,
    webhook_id,
)
from batchfleet.worker.observers import Reply
from pydantic import ValidationError

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("status", "verdict"),
    [(200, "delivered"), (204, "delivered"), (301, "fail"), (400, "fail"), (401, "fail"),
     (404, "fail"), (408, "fail"), (410, "gone"), (429, "retry"), (500, "retry"), (503, "retry")],
)  # fmt: skip
def test_status_verdicts(status: int, verdict: str) -> None:
    assert classify(status, None, NOW).verdict == verdict


@pytest.mark.parametrize(
    ("header", "seconds"),
    [(None, None), ("", None), ("120", 120.0), ("soon", None),
     ("Tue, 14 Nov 2023 22:15:20 GMT", 120.0), ("Tue, 14 Nov 2023 22:00:00 GMT", 0.0)],
)  # fmt: skip
def test_retry_after(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header, NOW) == seconds


def test_backoff_doubles_with_jitter_is_capped_and_honours_retry_after() -> None:
    cfg = WebhooksConfig(backoff_base_s=1.0, backoff_max_s=60.0)
    rng = random.Random(7)
    for attempt in range(1, 12):
        d = backoff_s(attempt, cfg, None, rng)
        nominal = min(60.0, 2.0 ** (attempt - 1))
        assert 0.75 * nominal <= d <= min(60.0, 1.25 * nominal)
    assert backoff_s(1, cfg, 30.0, rng) == 30.0
    assert backoff_s(1, cfg, 3600.0, rng) == 60.0


def test_busy_waits_double_up_to_the_attempt_timeout() -> None:
    cfg = WebhooksConfig(attempt_timeout_s=8.0)
    rng = random.Random(3)
    for busy, nominal in [(0, 0.5), (1, 1.0), (3, 4.0), (4, 8.0), (5, 8.0), (5000, 8.0)]:
        assert 0.5 * nominal <= busy_wait_s(busy, cfg, rng) <= nominal


def _answered(stored: bool, webhook: dict[str, str] | None, rid: str = "r1") -> Reply:
    body = {"id": rid, "model": "tiny", "inputs": ["x"]}
    if webhook:
        body["webhook"] = webhook  # type: ignore[assignment]
    request = Request.model_validate(body)
    result = Result(id=rid, model="tiny", status="ok", outputs=[[0.1]], finished_at_ms=5)
    return Reply(0, request, result, stored)


def test_only_newly_stored_results_with_a_webhook_are_owed_a_delivery() -> None:
    hook = {"url": "https://example.com/h", "secret_id": "acme", "format": "msgpack"}
    owed = deliveries(
        [
            _answered(True, hook, "a"),
            _answered(False, hook, "b"),  # a redelivered entry: its result existed already
            _answered(True, None, "c"),
        ]
    )
    assert [(d.request_id, d.secret_id, d.format) for d in owed] == [("a", "acme", "msgpack")]
    assert owed[0].webhook_id == webhook_id("tiny", "a", 5)
    assert webhook_id("tiny", "a", 5) != webhook_id("tiny", "a", 6)


@pytest.mark.parametrize(
    "webhook",
    [{"url": "ftp://example.com/x"}, {"url": "https://"}, {"url": "https://a b.com/x"},
     {"url": "https://example.com/x", "secret": "whsec_abc"},
     {"url": "https://example.com/x", "secret_id": "no spaces"}],
)  # fmt: skip
def test_bad_webhooks_are_invalid_requests(webhook: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        Request.model_validate({"id": "r", "model": "m", "inputs": ["x"], "webhook": webhook})


@pytest.mark.parametrize("secret", ["abc", "whsec_not base64!", "whsec_" + "QUJD"])
def test_secrets_must_be_whsec_base64_of_enough_bytes(secret: str) -> None:
    with pytest.raises(ValidationError):
        WebhooksConfig(secret=secret)  # type: ignore[arg-type]


def test_a_webhook_body_carries_the_result_as_stored_unknown_fields_too() -> None:
    import json

    from batchfleet.schemas.codec import pack
    from batchfleet.webhooks.tasks import encode_body

    stored = pack({"v": 1, "id": "r1", "model": "tiny", "status": "ok", "outputs": [[1.0]],
                   "finished_at_ms": 1_700_000_000_000, "from_a_newer_worker": {"x": 1}})  # fmt: skip
    body = json.loads(encode_body(stored, "json"))
    assert body["data"]["from_a_newer_worker"] == {"x": 1} and body["data"]["id"] == "r1"


def test_a_killed_attempt_is_redelivered_after_redeliver_after_s_not_an_hour() -> None:
    from batchfleet.worker.app import create_app

    from batchfleet.config import FleetConfig

    assert WebhooksConfig().redelivery_s() == 60.0  # 2 x the 15 s attempt timeout + 30
    assert WebhooksConfig(attempt_timeout_s=100).redelivery_s() == 230.0
    assert WebhooksConfig(redeliver_after_s=40).broker_transport_options() == {
        "visibility_timeout": 40,
        "unacked_restore_interval": 6,
        "unacked_restore_throttle": 1,
    }
    with pytest.raises(ValidationError, match="redeliver_after_s must exceed"):
        WebhooksConfig(attempt_timeout_s=30, redeliver_after_s=30)
    # every batchfleet Celery app (model workers send deliveries, webhooks workers run them)
    fleet = FleetConfig.model_validate({"redis_url": "redis://127.0.0.1:1/0"})
    app = create_app(fleet)
    assert app.conf.broker_transport_options["visibility_timeout"] == 60.0
