"""End to end with real Celery worker processes and a real redis-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from batchfleet.producer import AsyncProducer, Producer
from batchfleet.schemas.codec import decode_result
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.worker.app import create_app
from conftest import WorkerProcess, fleet_toml

from batchfleet.config import load_config

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def fleet(redis_url: str, tiny_embedder: Path, tiny_classifier: Path) -> str:
    return fleet_toml(
        redis_url,
        {
            "tiny": {
                "runner": "embedding",
                "path": str(tiny_embedder),
                "max_tokens": 64,
                "batch": {"max_batch_size": 32, "max_wait_ms": 5},
            },
            "sentiment": {
                "runner": "text-classification",
                "path": str(tiny_classifier),
                "max_tokens": 64,
                "lanes": 2,
                "batch": {"max_batch_size": 16},
            },
        },
    )


def _count_replies(
    r: redis.Redis, channel: str, ready: threading.Event, stop: threading.Event, seen: Counter[str]
) -> None:
    pubsub = r.pubsub()
    pubsub.subscribe(channel)
    while pubsub.get_message(timeout=1.0) is None:  # the subscribe confirmation
        pass
    ready.set()
    while not stop.is_set():
        msg = pubsub.get_message(timeout=0.1)
        if msg and msg["type"] == "message":
            seen[decode_result(msg["data"]).id] += 1
    pubsub.close()


def test_two_workers_answer_1000_requests_across_three_lanes_exactly_once(
    fleet: str, r: redis.Redis, redis_url: str, start_worker: Callable[..., WorkerProcess]
) -> None:
    # Given two workers sharing the consumer group, and a listener on the reply channel
    workers = [start_worker(fleet, f"w{i}") for i in range(2)]
    for w in workers:
        w.wait_ready(r, "tiny")
    producer = Producer(redis_url)
    published: Counter[str] = Counter()
    ready, stop = threading.Event(), threading.Event()
    listener = threading.Thread(
        target=_count_replies, args=(r, producer.reply_channel, ready, stop, published)
    )
    listener.start()
    assert ready.wait(10)

    # When 1,000 requests go in across three lanes
    texts = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(1000)]
    jobs = []
    for lane in range(3):
        jobs += producer.submit_many("tiny", texts[lane::3], priority=lane)
    results = list(producer.results(jobs, timeout=180))
    end = time.monotonic() + 10
    while len(published) < len(jobs) and time.monotonic() < end:
        time.sleep(0.05)  # let the listener drain its last messages
    time.sleep(0.2)  # and catch any duplicate that would follow
    stop.set()
    listener.join()

    # Then each has exactly one result, stored once and published once
    assert sorted(res.id for res in results) == sorted(j.id for j in jobs)
    assert all(res.ok and len(res.outputs[0]) == 32 for res in results)
    assert set(published) == {j.id for j in jobs}
    assert max(published.values()) == 1
    keys = ModelKeys("tiny")
    assert len(list(r.scan_iter(keys.result("*"), count=1000))) == 1000
    for lane in range(3):
        assert r.xpending(keys.lane(lane), GROUP)["pending"] == 0
        assert r.xlen(keys.lane(lane)) == 0
    # both workers took part, in micro-batches
    assert {res.timings.worker for res in results} == {"w0", "w1"}
    assert max(res.timings.batch_size for res in results) > 1


def test_one_worker_serves_two_models(
    fleet: str, r: redis.Redis, redis_url: str, start_worker: Callable[..., WorkerProcess]
) -> None:
    w = start_worker(fleet, "multi")
    w.wait_ready(r, "tiny")
    w.wait_ready(r, "sentiment")
    with Producer(redis_url) as producer:
        emb = producer.submit("tiny", ["what a day", "the dog"], priority=0)
        cls = producer.submit("sentiment", "what a day", priority=1)
        assert len(emb.outputs(timeout=30)) == 2
        (label,) = cls.outputs(timeout=30)
        assert label["label"] in {"negative", "neutral", "positive"}
        with pytest.raises(Exception, match="out of range"):
            producer.submit("sentiment", "x", priority=2)  # that model has two lanes


def test_async_producer_and_stats(
    fleet: str, r: redis.Redis, redis_url: str, start_worker: Callable[..., WorkerProcess]
) -> None:
    w = start_worker(fleet, "solo")
    w.wait_ready(r, "tiny")

    async def go() -> list[str]:
        async with AsyncProducer(redis_url) as producer:
            jobs = await producer.submit_many("tiny", [f"the dog {i}" for i in range(50)])
            single = await producer.submit("tiny", "what a day", priority=0)
            assert len(await single.outputs(timeout=30)) == 1
            return [res.status async for res in producer.results(jobs, timeout=60)]

    assert asyncio.run(go()) == ["ok"] * 50

    # celery inspect sees the worker and its batch statistics
    tmp = Path(w.log).with_name("inspect.toml")
    tmp.write_text(fleet)
    app = create_app(load_config(tmp))
    stats = app.control.inspect(timeout=5, destination=[f"solo@{_host()}"]).stats()
    assert stats, "the worker answered inspect stats"
    (info,) = stats.values()
    assert info["batchfleet"]["tiny"]["requests"]["ok"] == 51
    registered = app.control.inspect(timeout=5).registered()
    assert "batchfleet.batch.tiny" in next(iter(registered.values()))


def test_sigterm_finishes_and_exits(
    fleet: str, r: redis.Redis, redis_url: str, start_worker: Callable[..., WorkerProcess]
) -> None:
    w = start_worker(fleet, "graceful")
    w.wait_ready(r, "tiny")
    with Producer(redis_url) as producer:
        jobs = producer.submit_many("tiny", [f"the dog {i}" for i in range(200)], priority=2)
        assert jobs[0].result(timeout=30).ok
        assert w.stop(timeout=30) == 0
    assert not r.hexists(ModelKeys("tiny").workers, "graceful"), "deregistered on exit"


def _host() -> str:
    import socket

    return socket.gethostname()
