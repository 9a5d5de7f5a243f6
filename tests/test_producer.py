"""Producer behaviour against a real redis-server: backpressure, outages, validation."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from batchfleet.producer import AsyncProducer, Producer
from batchfleet.schemas.errors import ErrorCode, QueueFull, RequestRejected, Unavailable
from batchfleet.schemas.keys import ModelKeys
from batchfleet.worker.streams import ModelStreams

from batchfleet.redis_server import free_port

KEYS = ModelKeys("tiny")


def test_queue_full_past_the_lane_depth(r: redis.Redis, redis_url: str) -> None:
    ModelStreams(r, "tiny", 3, "w").ensure_groups(max_depth=5)
    producer = Producer(redis_url)
    for i in range(5):
        producer.submit("tiny", f"text {i}", priority=0)
    with pytest.raises(QueueFull) as info:
        producer.submit("tiny", "one too many", priority=0)
    assert info.value.code is ErrorCode.QUEUE_FULL
    assert r.xlen(KEYS.lane(0)) == 5
    producer.submit("tiny", "another lane has room", priority=1)

    # submit_many stops at the limit and says which went in
    with pytest.raises(QueueFull) as many:
        producer.submit_many("tiny", [f"t{i}" for i in range(10)], priority=2)
    assert len(many.value.accepted) == 5  # type: ignore[attr-defined]
    assert r.xlen(KEYS.lane(2)) == 5

    # a raw client running the documented script sees QUEUEFULL
    from batchfleet.producer.submit import SUBMIT_LUA

    with pytest.raises(redis.ResponseError, match="QUEUEFULL"):
        r.eval(SUBMIT_LUA, 2, KEYS.lane(0), KEYS.max_depth, "json", "{}")

    # unbounded again once workers publish no limit
    ModelStreams(r, "tiny", 3, "w").ensure_groups(max_depth=None)
    producer.submit("tiny", "room again", priority=0)


def test_unreachable_redis_raises_a_clear_error_quickly() -> None:
    producer = Producer(f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"cannot reach Redis at redis://127\.0\.0\.1"):
        producer.submit("tiny", "hello")
    assert time.monotonic() - started < 30


def test_invalid_requests_are_refused_before_redis(redis_url: str, r: redis.Redis) -> None:
    producer = Producer(redis_url)
    cases = [
        (dict(model="tiny", inputs=[]), ErrorCode.INVALID_REQUEST),
        (dict(model="tiny", inputs=[" "]), ErrorCode.EMPTY_INPUT),
        (dict(model="tiny", inputs=["x" * 30_000]), ErrorCode.TOO_LARGE),
        (dict(model="tiny", inputs=["x"], priority=3), ErrorCode.INVALID_REQUEST),
        (dict(model="tiny", inputs=["x"], deadline_ms=0), ErrorCode.INVALID_REQUEST),
    ]
    for kwargs, code in cases:
        with pytest.raises(RequestRejected) as info:
            producer.submit(**kwargs)  # type: ignore[arg-type]
        assert info.value.code is code, kwargs
    with pytest.raises(ValueError):
        producer.submit("bad name", "x")
    assert not list(r.scan_iter("bf:*"))


def test_submit_many_survives_a_flushed_script_cache(r: redis.Redis) -> None:
    """The submit script is called by EVALSHA alone (no SCRIPT EXISTS first): after Redis
    forgets it (a restart, SCRIPT FLUSH), the NOSCRIPT replies load it and rerun."""
    producer = Producer(client=r)
    first = producer.submit_many("m", ["one", "two"])
    r.script_flush()
    again = producer.submit_many("m", ["three", "four", "five"], priority=2)
    assert len(first) == 2 and len(again) == 3
    keys = ModelKeys("m")
    assert r.xlen(keys.lane(1)) == 2 and r.xlen(keys.lane(2)) == 3


def test_async_submit_many_survives_a_flushed_script_cache(r: redis.Redis, redis_url: str) -> None:
    async def go() -> tuple[int, int]:
        async with AsyncProducer(redis_url) as producer:
            first = await producer.submit_many("am", ["one", "two"], priority=0)
            r.script_flush()
            again = await producer.submit_many("am", ["three"], priority=0)
            return len(first), len(again)

    assert asyncio.run(go()) == (2, 1)
    assert r.xlen(ModelKeys("am").lane(0)) == 3
