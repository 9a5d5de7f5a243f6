"""Webhook delivery state in a real Redis: endpoint slots, the scheduled set, the status key,
disabled endpoints. Attempts run in-process (no Celery) against real local HTTP receivers,
with an injected clock."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis
from batchfleet.schemas.codec import encode_result
from batchfleet.schemas.keys import ModelKeys, WebhookKeys
from batchfleet.schemas.messages import Result
from batchfleet.webhooks import deadletter, endpoints
from batchfleet.webhooks.config import WebhooksConfig
from batchfleet.webhooks.errors import DeliveryFailed
from batchfleet.webhooks.status import webhook_status
from batchfleet.webhooks.tasks import Deliverer, Delivery, webhook_id
from batchfleet.webhooks.worker import CLAIM_LEASE_MS, Scheduler
from webhook_receiver import Answer, Receiver

from batchfleet.cli import main as cli_main

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
NOW = 1_700_000_000.0
KEYS = WebhookKeys()


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def deliverer(r: redis.Redis) -> Callable[..., Deliverer]:
    def make(**overrides: object) -> Deliverer:
        cfg = WebhooksConfig.model_validate(
            {"secret": SECRET, "allow_http": True, "allow": ["127.0.0.0/8"], "max_attempts": 3,
             "attempt_timeout_s": 5.0, **overrides}
        )  # fmt: skip
        return Deliverer(cfg, r, {"tiny": 120}, clock=Clock())

    return make


def stored(r: redis.Redis, url: str, rid: str = "r1") -> Delivery:
    """A stored result of model `tiny` and the delivery owed for it."""
    result = Result(id=rid, model="tiny", status="ok", outputs=[[0.5]], finished_at_ms=5)
    r.set(ModelKeys("tiny").result(rid), encode_result(result, "json"), ex=120)
    return Delivery(model="tiny", request_id=rid, url=url, webhook_id=webhook_id("tiny", rid, 5))


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [("https://Example.COM/x?y", "https://example.com:443"),
     ("http://example.com:8080/", "http://example.com:8080"),
     ("https://[::1]/hook", "https://[::1]:443")],
)  # fmt: skip
def test_endpoint_is_scheme_host_and_port(url: str, endpoint: str) -> None:
    assert endpoints.endpoint_of(url) == endpoint


def test_slots_cap_an_endpoint_across_clients_and_leases_expire(
    r: redis.Redis, redis_url: str
) -> None:
    # Given two "workers" (separate clients) sharing a cap of 2 slots per endpoint
    other = redis.Redis.from_url(redis_url)
    a, b = endpoints.Slots(r, 2, 1, 10.0, 4), endpoints.Slots(other, 2, 1, 10.0, 4)
    ep, elsewhere = "https://slow.example:443", "https://fine.example:443"
    now = 1_000_000
    # When both take slots: the third is refused, another endpoint is unaffected
    first, second = a.acquire(ep, now), b.acquire(ep, now)
    assert first and second
    assert a.acquire(ep, now) is None and b.acquire(ep, now) is None
    assert a.acquire(elsewhere, now) is not None
    # Then a released slot is free again, and a lease of a worker that died ends by itself
    a.release(ep, first, "answered")
    assert b.acquire(ep, now) is not None
    assert a.acquire(ep, now) is None
    assert a.acquire(ep, now + a.lease_ms + 1) is not None
    other.close()


def test_an_endpoint_that_timed_out_gets_the_slow_cap_until_it_answers(r: redis.Redis) -> None:
    slots, ep, now = endpoints.Slots(r, 3, 1, 10.0, 4), "https://slow.example:443", 1_000_000
    token = slots.acquire(ep, now)
    assert token is not None
    slots.release(ep, token, "timeout")
    held = slots.acquire(ep, now)
    assert held is not None and slots.acquire(ep, now) is None  # 1 slot while slow
    slots.release(ep, held, "answered")
    assert [slots.acquire(ep, now) is not None for _ in range(4)] == [True, True, True, False]


def test_slow_endpoints_together_get_only_the_slow_lane(r: redis.Redis) -> None:
    # Given a worker whose slow lane has 2 places, and 3 endpoints that timed out
    slots, now = endpoints.Slots(r, 4, 1, 10.0, 2), 1_000_000
    slow = [f"https://slow{i}.example:443" for i in range(3)]
    for ep in slow:
        token = slots.acquire(ep, now)
        assert token is not None
        slots.release(ep, token, "timeout")
    # When each gets a delivery: the third finds the lane full, and holds no slot
    first, second = slots.acquire(slow[0], now), slots.acquire(slow[1], now)
    assert first and second and slots.acquire(slow[2], now) is None
    assert r.zcard(KEYS.inflight(slow[2])) == 0
    # Then a healthy endpoint is unaffected, and a place freed in the lane is taken again
    assert slots.acquire("https://fine.example:443", now) is not None
    slots.release(slow[0], first, "timeout")
    assert slots.acquire(slow[2], now) is not None


def test_scheduler_releases_due_entries_once_and_a_crashed_claim_comes_back(
    r: redis.Redis, redis_url: str
) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.sent: list[tuple[dict[str, object], int]] = []

        def send_task(self, name: str, *, kwargs: dict[str, object], retries: int, queue: str):  # type: ignore[no-untyped-def]
            self.sent.append((kwargs, retries))

    def entry(n: int) -> str:
        return json.dumps({"kwargs": {"n": n}, "retries": n}, sort_keys=True)

    r.zadd(KEYS.scheduled, {entry(1): 1000, entry(2): 2000, entry(3): 9000})
    app = Recorder()
    scheduler = Scheduler(r, app)  # type: ignore[arg-type]
    # When due entries are released: each once, and the next due time is known
    assert scheduler.release_due(2500) == (2, 9000)
    assert scheduler.release_due(2500) == (0, 9000)
    assert app.sent == [({"n": 1}, 1), ({"n": 2}, 2)]
    assert r.zcard(KEYS.scheduled) == 1
    # Given a worker that died after claiming an entry but before queuing it
    claim = r.register_script(scheduler._claim.script)
    claimed, _ = claim(keys=[KEYS.scheduled], args=[9000, 10, CLAIM_LEASE_MS])
    assert claimed == [entry(3).encode()]
    assert scheduler.release_due(9000) == (0, 9000 + CLAIM_LEASE_MS)
    # Then another worker queues it when the claim's lease has ended
    assert scheduler.release_due(9000 + CLAIM_LEASE_MS)[0] == 1
    assert app.sent[-1] == ({"n": 3}, 3) and r.zcard(KEYS.scheduled) == 0


def test_status_follows_a_delivery_from_retry_to_delivered(
    r: redis.Redis, deliverer: Callable[..., Deliverer]
) -> None:
    with Receiver([Answer(503, {"Retry-After": "7"}), Answer(204)]) as rx:
        worker = deliverer()
        d = stored(r, rx.url)
        assert webhook_status(r, "tiny", "r1") is None  # not attempted yet
        # When the first attempt gets a 503: the retry waits in the scheduled set
        assert worker.run(d, 0)["retry_in_s"] >= 7
        status = webhook_status(r, "tiny", "r1")
        assert status is not None and status.state == "scheduled"
        assert (status.attempts, status.http_status, status.reason) == (1, 503, "HTTP 503")
        [(member, due)] = r.zrange(KEYS.scheduled, 0, -1, withscores=True)
        assert due == status.next_attempt_ms >= NOW * 1000 + 7000
        assert json.loads(member)["retries"] == 1
        # When the second attempt succeeds
        assert worker.run(d, 1)["attempts"] == 2
    status = webhook_status(r, "tiny", "r1")
    assert status is not None and status.state == "delivered" and status.attempts == 2
    assert status.webhook_id == d.webhook_id and status.dead_letter_id is None
    assert 0 < r.ttl(ModelKeys("tiny").webhook_status("r1")) <= 120  # the model's result TTL


def test_a_dripping_endpoint_times_out_is_retried_and_marked_slow(
    r: redis.Redis, deliverer: Callable[..., Deliverer]
) -> None:
    # Given an endpoint whose answer would take about 30 s, a byte every 50 ms
    worker = deliverer(attempt_timeout_s=0.5, read_timeout_s=5.0)
    with Receiver([Answer(body=b"x" * 600, drip_s=0.05)]) as rx:
        # When a delivery's attempt runs out of time
        assert worker.run(stored(r, rx.url), 0)["retry_in_s"] > 0
        assert rx.cut_off.wait(20)
    # Then it is a timeout, retried per the backoff, and the endpoint is slow
    status = webhook_status(r, "tiny", "r1")
    assert status is not None and status.state == "scheduled"
    assert status.reason.startswith("attempt timed out") and status.http_status is None
    assert r.zcard(KEYS.scheduled) == 1
    assert r.exists(KEYS.slow(endpoints.endpoint_of(rx.url)))


def test_a_refused_url_is_reported_without_a_connection(
    r: redis.Redis, deliverer: Callable[..., Deliverer]
) -> None:
    d = stored(r, "https://10.1.2.3/hook")
    with pytest.raises(DeliveryFailed):
        deliverer().run(d, 0)
    status = webhook_status(r, "tiny", "r1")
    assert status is not None and status.state == "refused" and "private" in status.reason
    [record] = deadletter.list_failed(r)
    assert status.dead_letter_id == record.id


def test_a_busy_endpoint_costs_no_attempt(
    r: redis.Redis, deliverer: Callable[..., Deliverer]
) -> None:
    # Given an endpoint whose only slot another worker holds
    worker = deliverer(endpoint_concurrency=1)
    with Receiver() as rx:
        ep = endpoints.endpoint_of(rx.url)
        assert worker.slots.acquire(ep, worker.now_ms()) is not None
        d = stored(r, rx.url)
        # When a delivery to it runs: it goes back to the scheduled set, busy once, same retries
        out = worker.run(d, 2)
    assert out["endpoint_busy"] and rx.connections == 0
    [member] = r.zrange(KEYS.scheduled, 0, -1)
    assert json.loads(member)["retries"] == 2 and json.loads(member)["kwargs"]["busy"] == 1
    assert webhook_status(r, "tiny", "r1") is None


def test_410_disables_the_url_until_enabled(
    r: redis.Redis,
    deliverer: Callable[..., Deliverer],
    tmp_path: object,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    worker = deliverer()
    with Receiver([Answer(410)]) as rx:
        with pytest.raises(DeliveryFailed):
            worker.run(stored(r, rx.url, "a"), 0)
        with pytest.raises(DeliveryFailed):
            worker.run(stored(r, rx.url, "b"), 0)
        assert rx.connections == 1  # the second was not attempted
        statuses = [webhook_status(r, "tiny", rid) for rid in ("a", "b")]
        assert [s.state if s else None for s in statuses] == ["disabled", "disabled"]
        [disabled] = endpoints.list_disabled(r)
        assert disabled.url == rx.url and "410" in disabled.reason

        # The CLI lists and re-enables it
        config = tmp_path / "fleet.toml"  # type: ignore[operator]
        config.write_text(f'redis_url = "{redis_url}"\n')
        capsys.readouterr()
        assert cli_main(["webhooks", "disabled", "-c", str(config)]) == 0
        assert rx.url in capsys.readouterr().out
        assert cli_main(["webhooks", "status", "tiny", "b", "-c", str(config)]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "disabled"
        assert cli_main(["webhooks", "enable", rx.url, "-c", str(config)]) == 0
        assert endpoints.list_disabled(r) == []
        assert cli_main(["webhooks", "enable", rx.url, "-c", str(config)]) == 1  # not disabled
        assert worker.run(stored(r, rx.url, "c"), 0)["status"] == 200
    assert cli_main(["webhooks", "status", "tiny", "nope", "-c", str(config)]) == 1
