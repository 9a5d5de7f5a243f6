"""Faults inflicted for real: kill -9 of workers, Redis killed and restarted, poison and
crashing requests, SIGTERM mid-batch. Real worker processes, real redis-server."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import decode_result, envelope_of
from batchfleet.schemas.errors import ErrorCode, Unavailable
from batchfleet.schemas.keys import GROUP, ModelKeys
from conftest import WorkerProcess, fleet_toml

from batchfleet.config import WorkerConfig
from batchfleet.redis_server import LocalRedis

pytestmark = pytest.mark.timeout(300)
KEYS = ModelKeys("tiny")


def faulty(
    path: Path, batch: dict[str, object] | None = None, **options: object
) -> dict[str, object]:
    return {
        "runner": "fault_handlers:FaultyEmbedder",
        "path": str(path),
        "max_tokens": 32,
        "batch": {"max_batch_size": 16, "max_wait_ms": 5, **(batch or {})},
        "options": options,
    }


class Replies:
    """Counts every result published on a channel (to catch a second version of a result)."""

    def __init__(self, r: redis.Redis, channel: str) -> None:
        self.seen: Counter[str] = Counter()
        self.at: dict[str, float] = {}
        """When each result was first published (monotonic)."""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(r, channel), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self, r: redis.Redis, channel: str) -> None:
        pubsub = r.pubsub()
        pubsub.subscribe(channel)
        while pubsub.get_message(timeout=1.0) is None:
            pass
        self._ready.set()
        while not self._stop.is_set():
            msg = pubsub.get_message(timeout=0.1)
            if msg and msg["type"] == "message":
                rid = decode_result(msg["data"]).id
                self.seen[rid] += 1
                self.at.setdefault(rid, time.monotonic())

    def stop(self, expect: int) -> Counter[str]:
        end = time.monotonic() + 10
        while len(self.seen) < expect and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.3)
        self._stop.set()
        self._thread.join()
        return self.seen


DEFAULTS = WorkerConfig()


def default_fleet(redis_url: str, tiny_embedder: Path) -> str:
    """A GPU-like ~40 ms-per-batch model, with the default takeover settings (dead after
    6 s without a heartbeat, the idle fallback at 300 s, max_deliveries 3)."""
    defaults = DEFAULTS.model_dump(
        include={"claim_idle_ms", "heartbeat_timeout_ms", "max_deliveries"}
    )
    return fleet_toml(redis_url, {"tiny": faulty(tiny_embedder, batch_ms=40, row_ms=1)}, defaults)


def test_chaos_kill_9(
    redis_url: str, r: redis.Redis, tiny_embedder: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    # Given three workers with the default takeover settings
    fleet = default_fleet(redis_url, tiny_embedder)
    workers = [start_worker(fleet, f"chaos-{i}") for i in range(3)]
    for w in workers:
        w.wait_ready(r, "tiny")
    producer = Producer(redis_url)
    replies = Replies(r, producer.reply_channel)

    # When 5,000 requests go in and five random workers are kill -9'd (and restarted) meanwhile
    texts = [f"the dog {i} jumps over the fox" for i in range(5000)]
    jobs = []
    for lane in range(3):
        jobs += producer.submit_many("tiny", texts[lane::3], priority=lane)
    rng = random.Random(4)
    kills = 0
    orphans: dict[str, float] = {}  # request id → when its worker was killed
    while kills < 5:
        time.sleep(rng.uniform(0.6, 1.2))
        victim = rng.randrange(len(workers))
        held = pending_of(r, workers[victim].name)
        workers[victim].kill()
        killed_at = time.monotonic()
        orphans.update({rid: killed_at for rid in held})
        kills += 1
        workers[victim] = start_worker(fleet, f"chaos-{victim}-r{kills}")
        remaining = sum(r.xlen(KEYS.lane(i)) for i in range(3))
        assert remaining > 0, f"the run ended before kill {kills}: slow the runner down"

    # Then every request has exactly one result, stored once and published once
    results = {res.id: res for res in producer.results(jobs, timeout=240)}
    seen = replies.stop(len(jobs))
    assert len(results) == len(jobs) == 5000
    assert set(seen) == set(results) and max(seen.values()) == 1, "a result was published twice"
    # ok, or (a request whose holders kept dying past max_deliveries) poisoned, never lost
    statuses = Counter(res.status if res.ok else res.error.code.value for res in results.values())
    assert set(statuses) <= {"ok", "poisoned"}, statuses
    assert sum(r.xlen(KEYS.lane(i)) for i in range(3)) == 0
    assert all(r.xpending(KEYS.lane(i), GROUP)["pending"] == 0 for i in range(3))
    waits = sorted(replies.at[rid] - t for rid, t in orphans.items() if rid in replies.at)
    served = Counter(res.timings.worker for res in results.values())
    print(
        f"chaos: 5000 requests, {kills} kill -9, lost 0, duplicated 0, {dict(statuses)}; "
        f"{len(orphans)} orphaned requests answered {waits[0]:.1f}-{waits[-1]:.1f} s after "
        f"their worker was killed (p50 {waits[len(waits) // 2]:.1f} s, behind a backlog of "
        f"thousands); served by {dict(served)}"
    )


def test_a_killed_workers_requests_are_answered_within_seconds_with_defaults(
    redis_url: str, r: redis.Redis, tiny_embedder: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    # Given two workers with the default takeover settings and a steady backlog
    fleet = default_fleet(redis_url, tiny_embedder)
    victim, survivor = (start_worker(fleet, f"orphans-{i}") for i in range(2))
    for w in (victim, survivor):
        w.wait_ready(r, "tiny")
    producer = Producer(redis_url)
    replies = Replies(r, producer.reply_channel)
    jobs = producer.submit_many("tiny", [f"the dog {i} jumps" for i in range(3000)])
    end = time.monotonic() + 30
    while not (held := pending_of(r, victim.name)):
        assert time.monotonic() < end, "the victim never held a request"
        time.sleep(0.05)
    # When one is kill -9'd holding requests
    victim.kill()
    killed_at = time.monotonic()
    taken_at = None
    while any(rid not in replies.at for rid in held):
        assert time.monotonic() - killed_at < 120, "orphans never answered"
        if taken_at is None and not pending_of(r, victim.name):
            taken_at = time.monotonic()
        time.sleep(0.05)
    # Then the survivor took them over once the victim's heartbeat went stale and answered
    # them (the default timeout is 6 s; the claim_idle_ms fallback is 300 s away)
    waits = sorted(replies.at[rid] - killed_at for rid in held)
    assert all(res.ok for res in producer.results(jobs, timeout=120))
    replies.stop(len(jobs))
    print(
        f"orphans: {len(held)} requests held by a kill -9'd worker taken over "
        f"{(taken_at or killed_at) - killed_at:.1f} s after the kill, answered "
        f"{waits[0]:.1f}-{waits[-1]:.1f} s after it (defaults: heartbeat_timeout_ms "
        f"{DEFAULTS.heartbeat_timeout_ms}, claim_idle_ms {DEFAULTS.claim_idle_ms})"
    )
    assert waits[-1] < DEFAULTS.claim_idle_ms / 1000, (
        "taken by the idle fallback, not the heartbeat"
    )


def pending_of(r: redis.Redis, consumer: str) -> list[str]:
    """Request ids of the entries a consumer holds (read, not answered)."""
    ids = []
    for lane in range(3):
        for p in r.xpending_range(KEYS.lane(lane), GROUP, "-", "+", 10_000, consumername=consumer):
            for _, fields in r.xrange(KEYS.lane(lane), p["message_id"], p["message_id"]):
                ids.append(decode_request_id(fields))
    return ids


def decode_request_id(fields: dict[bytes, bytes]) -> str:
    rid = envelope_of(fields).id
    assert rid is not None
    return rid


def test_redis_restart_with_aof_loses_no_accepted_request(
    tiny_embedder: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    # Given a Redis with appendfsync always, a worker, and a producer submitting steadily
    server = LocalRedis(appendonly=True, appendfsync="always")
    url = server.start()
    try:
        fleet = fleet_toml(url, {"tiny": faulty(tiny_embedder, batch_ms=5)})
        client = redis.Redis.from_url(url)
        start_worker(fleet, "survivor").wait_ready(client, "tiny")
        producer = Producer(url)
        accepted, refused = [], 0
        stop = threading.Event()

        def submit() -> None:
            nonlocal refused
            i = 0
            while not stop.is_set():
                try:
                    accepted.append(producer.submit("tiny", f"the dog {i}", priority=i % 3))
                except Unavailable:
                    refused += 1
                i += 1
                time.sleep(0.005)

        thread = threading.Thread(target=submit)
        thread.start()
        # When Redis is killed (SIGKILL) mid-run and comes back a second later
        time.sleep(1.5)
        server.crash()
        time.sleep(1.0)
        server.start()
        time.sleep(2.0)
        stop.set()
        thread.join()

        # Then every request whose submit returned gets its result
        lost = [j.id for j in accepted if not j.result(timeout=60).ok]
        assert not lost
        assert len(accepted) > 100
        print(f"redis restart: {len(accepted)} accepted, {refused} refused while down, lost 0")
    finally:
        server.stop()


def test_poison_request_in_a_batch_of_32(
    redis_url: str, r: redis.Redis, tiny_embedder: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    fleet = fleet_toml(
        redis_url,
        {"tiny": faulty(tiny_embedder, {"max_batch_size": 32}, batch_ms=300,
                        poison_text="poison")},
    )  # fmt: skip
    worker = start_worker(fleet, "bisect")
    worker.wait_ready(r, "tiny")
    texts = [f"the dog {i}" for i in range(31)]
    texts.insert(17, "poison")
    with Producer(redis_url) as producer:
        # a first request keeps the device busy while the 32 queue up behind it
        warmup = producer.submit("tiny", "the fox", priority=0)
        jobs = producer.submit_many("tiny", texts, priority=0)
        assert warmup.result(timeout=60).ok
        results = [j.result(timeout=60) for j in jobs]
        assert [res.status for res in results].count("ok") == 31
        bad = results[17]
        assert bad.status == "error" and bad.error.code is ErrorCode.INFERENCE_FAILED
        # the poison shared its batch (it was bisected out); its batch-mates were answered
        mates = [x for x in results if x.timings.batch_id == bad.timings.batch_id]
        assert bad.timings.batch_size > 1 and all(m.ok for m in mates if m is not bad)
        assert worker.alive()
        assert producer.submit("tiny", "the fox").result(timeout=30).ok


def test_request_that_crashes_workers_is_dead_lettered(
    redis_url: str, r: redis.Redis, tiny_embedder: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    # Given a request that kills any worker computing it, among good ones
    fleet = fleet_toml(
        redis_url,
        {"tiny": faulty(tiny_embedder, crash_text="segfault")},
        worker={"max_deliveries": DEFAULTS.max_deliveries},
    )
    with Producer(redis_url) as producer:
        good = producer.submit_many("tiny", [f"the dog {i}" for i in range(10)], priority=1)
        crash = producer.submit("tiny", "segfault", priority=1)
        # When workers keep dying on it and get restarted
        restarts = 0
        worker = start_worker(fleet, "victim-0")
        while crash.peek() is None:
            assert restarts <= 6, "the poison request was never dead-lettered"
            if not worker.alive():
                restarts += 1
                worker = start_worker(fleet, f"victim-{restarts}")
            time.sleep(0.2)
        # Then it is dead-lettered with an error result, and the good ones are answered
        res = crash.result(timeout=1)
        assert res.status == "error" and res.error.code is ErrorCode.POISONED
        good_results = [j.result(timeout=60) for j in good]
        assert all(g.ok for g in good_results), [(g.status, g.error) for g in good_results]
        dead = r.xrange(KEYS.dead)
        assert [d[1][b"code"] for d in dead] == [b"poisoned"]
        assert restarts == 3, "killed once per delivery up to max_deliveries"
        assert worker.alive()


def test_sigterm_during_a_batch_publishes_it_before_exit(
    redis_url: str, r: redis.Redis, tiny_embedder: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    fleet = fleet_toml(
        redis_url, {"tiny": faulty(tiny_embedder, batch_ms=1500)}, worker={"claim_idle_ms": 500}
    )
    with Producer(redis_url) as producer:
        # Given a batch of 8 running (queued before the worker starts: it reads them at once)
        running = producer.submit_many("tiny", [f"the dog {i}" for i in range(8)], priority=0)
        worker = start_worker(fleet, "sigterm")
        worker.wait_ready(r, "tiny")
        end = time.monotonic() + 30
        while r.xpending(KEYS.lane(0), GROUP)["pending"] < 8:
            assert time.monotonic() < end
            time.sleep(0.02)
        # and 8 more read while it runs
        waiting = producer.submit_many("tiny", [f"the fox {i}" for i in range(8)], priority=0)
        time.sleep(0.3)
        # When SIGTERM arrives mid-batch
        started = time.monotonic()
        assert worker.stop(timeout=30) == 0
        took = time.monotonic() - started
        # Then the running batch was published before exit, within the batch time
        assert all((res := j.peek()) is not None and res.ok for j in running)
        assert took < 10
        # and what it had not started is left to the fleet: another worker answers it
        unanswered = [j for j in waiting if j.peek() is None]
        start_worker(fleet, "successor").wait_ready(r, "tiny")
        assert all(j.result(timeout=60).ok for j in unanswered)
        print(
            f"sigterm: {len(running)} in flight published, {len(unanswered)} handed over, exit in {took:.1f}s"
        )
