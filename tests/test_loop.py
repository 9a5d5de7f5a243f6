"""The batch loop in-process against a real redis-server: bad input, deadlines,
redelivery, idempotent results, reply channels."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import decode_result, encode_request
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Request
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runner import Encoded
from batchfleet.worker.runners.embedding import EmbeddingRunner
from batchfleet.worker.streams import Entry, Finish, ModelStreams
from conftest import next_message
from devices import DEVICE

from batchfleet.config import ModelConfig, WorkerConfig

MODEL = "tiny"
KEYS = ModelKeys(MODEL)


@pytest.fixture(scope="module")
def handler(tiny_embedder: Path) -> EmbeddingRunner:
    return EmbeddingRunner(tiny_embedder, device=DEVICE, max_tokens=32)


def run_loop(r: redis.Redis, handler: Any, consumer: str = "w1", **worker: Any) -> BatchLoop:
    cfg = ModelConfig(path="/unused", max_tokens=32)
    loop = BatchLoop(
        MODEL,
        cfg,
        handler,
        r,
        consumer=consumer,
        worker=WorkerConfig(block_ms=50, **worker),
        burst=True,
    )
    loop.run()
    return loop


def result_of(r: redis.Redis, request_id: str) -> Any:
    raw = r.get(KEYS.result(request_id))
    assert raw is not None, f"no result for {request_id}"
    return decode_result(raw)


def test_good_requests_get_results_with_timings(r: redis.Redis, handler: EmbeddingRunner) -> None:
    producer = Producer(client=r)
    jobs = [
        producer.submit(MODEL, ["the dog", "the quick brown fox"], priority=i % 3)
        for i in range(20)
    ]
    loop = run_loop(r, handler)
    for job in jobs:
        res = job.result(timeout=1)
        assert res.status == "ok" and len(res.outputs or []) == 2
        assert res.truncated == [False, False]
        rows = handler.encode(["the dog", "the quick brown fox"])
        assert res.usage is not None and res.usage.completion_tokens == 0
        assert res.usage.prompt_tokens == sum(len(row.ids) for row in rows)
        t = res.timings
        assert t.worker == "w1" and t.batch_size >= 2 and t.batch_id
        assert 0 <= t.queued_ms <= t.total_ms and t.inference_ms > 0
    assert all(r.xlen(KEYS.lane(i)) == 0 for i in range(3)), "acked entries are deleted"
    assert loop.stats.snapshot()["requests"] == {"ok": 20}


def test_each_result_reports_its_whole_batch_size(r: redis.Redis, handler: EmbeddingRunner) -> None:
    # Given 40 requests of two inputs each, queued at once (so batches hold several)
    producer = Producer(client=r)
    jobs = producer.submit_many(MODEL, [["the dog", "a cat"]] * 40, priority=1)
    run_loop(r, handler)
    # Then every member of a batch reports the batch's rows: 2 per request in it
    by_batch: dict[str, list[int]] = {}
    for job in jobs:
        t = job.result(timeout=1).timings
        by_batch.setdefault(t.batch_id, []).append(t.batch_size)
    assert any(len(sizes) > 1 for sizes in by_batch.values())
    for sizes in by_batch.values():
        assert sizes == [2 * len(sizes)] * len(sizes)


def test_bad_entries_never_stop_the_loop(r: redis.Redis, handler: EmbeddingRunner) -> None:
    producer = Producer(client=r)
    good = producer.submit(MODEL, "the dog", priority=0)
    lane = KEYS.lane(1)
    r.xadd(lane, {"msgpack": b"\xc1 not msgpack"})  # nobody to answer: dead letter
    r.xadd(
        lane, {"msgpack": msgpack.packb({"id": "wrong-model", "model": "other", "inputs": ["x"]})}
    )
    r.xadd(lane, {"msgpack": msgpack.packb({"id": "empty", "model": MODEL, "inputs": [""]})})
    r.xadd(lane, {"json": json.dumps({"id": "huge", "model": MODEL, "inputs": ["a" * 50_000]})})
    r.xadd(lane, {"msgpack": msgpack.packb({"id": "typo", "model": MODEL, "input": ["x"]})})
    good2 = producer.submit(MODEL, "the quick brown fox", priority=1)

    loop = run_loop(r, handler)

    assert good.result(timeout=1).ok and good2.result(timeout=1).ok
    for rid, code in [
        ("wrong-model", ErrorCode.UNKNOWN_MODEL),
        ("empty", ErrorCode.EMPTY_INPUT),
        ("huge", ErrorCode.TOO_LARGE),
        ("typo", ErrorCode.INVALID_REQUEST),
    ]:
        res = result_of(r, rid)
        assert res.status == "error" and res.error.code is code, rid
    assert r.get(KEYS.result("huge")).startswith(b"{"), "a JSON request gets a JSON result"
    dead = r.xrange(KEYS.dead)
    assert len(dead) == 1 and dead[0][1][b"code"] == b"malformed"
    assert dead[0][1][b"orig_msgpack"] == b"\xc1 not msgpack"
    assert r.xpending(lane, GROUP)["pending"] == 0
    assert loop.stats.snapshot()["dead_letters"] == 1


def test_expired_requests_are_answered_without_computing(
    r: redis.Redis, handler: EmbeddingRunner
) -> None:
    producer = Producer(client=r)
    late = producer.submit(MODEL, "the dog", deadline_ms=1)
    time.sleep(0.05)
    fine = producer.submit(MODEL, "the dog", deadline_ms=60_000)
    loop = run_loop(r, handler)
    res = late.result(timeout=1)
    assert res.status == "expired" and res.error.code is ErrorCode.DEADLINE_EXCEEDED
    assert res.outputs is None
    assert fine.result(timeout=1).ok
    assert loop.stats.rows == 1, "the expired request was not computed"


def test_reply_channel_gets_the_result(r: redis.Redis, handler: EmbeddingRunner) -> None:
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("my-replies")
    req = Request(id="chan-1", model=MODEL, inputs=["the dog"], reply="my-replies")
    r.xadd(KEYS.lane(0), encode_request(req))
    run_loop(r, handler)
    msg = next_message(pubsub)
    assert msg is not None and decode_result(msg["data"]).id == "chan-1"


def _pending_on_ghost(r: redis.Redis, req: Request) -> str:
    """Given an entry delivered to a consumer that then died (never acked)."""
    streams = ModelStreams(r, MODEL, 3, "ghost")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), encode_request(req))
    (entry,) = streams.read({0: 10}, None)
    return entry.id


def test_entries_of_a_dead_worker_are_reclaimed(r: redis.Redis, handler: EmbeddingRunner) -> None:
    entry_id = _pending_on_ghost(r, Request(id="orphan", model=MODEL, inputs=["the dog"]))
    time.sleep(0.15)
    run_loop(r, handler, claim_idle_ms=100)
    assert result_of(r, "orphan").ok
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0
    assert r.xrange(KEYS.lane(0), entry_id, entry_id) == []


def test_redelivered_request_with_a_result_is_not_recomputed(
    r: redis.Redis, handler: EmbeddingRunner
) -> None:
    req = Request(id="done-before", model=MODEL, inputs=["the dog"])
    _pending_on_ghost(r, req)
    r.set(KEYS.result(req.id), b"the first result stands")
    time.sleep(0.15)
    loop = run_loop(r, handler, claim_idle_ms=100)
    assert r.get(KEYS.result(req.id)) == b"the first result stands"
    assert loop.stats.batches == 0
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def test_a_result_is_written_once(r: redis.Redis) -> None:
    streams = ModelStreams(r, MODEL, 3, "w")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    (entry,) = streams.read({0: 1}, None)
    first = streams.finish([Finish(entry, "rid", b"one", 60, "c")])
    second = streams.finish([Finish(entry, "rid", b"two", 60, "c")])
    assert (first, second) == ([True], [False])
    assert r.get(KEYS.result("rid")) == b"one"
    assert 0 < r.ttl(KEYS.result("rid")) <= 60


class Poisoned(EmbeddingRunner):
    """Raises whenever a batch holds the text 'poison' (as token ids)."""

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        if any(r.ids == self._poison for r in rows):
            raise RuntimeError("model blew up on this input")
        return super().run(rows)


def test_a_failing_request_does_not_sink_its_batch(tiny_embedder: Path, r: redis.Redis) -> None:
    handler = Poisoned(tiny_embedder, device=DEVICE, max_tokens=32)
    handler._poison = handler.encode(["poison"])[0].ids  # type: ignore[attr-defined]
    producer = Producer(client=r)
    jobs = producer.submit_many(MODEL, ["the dog", "poison", "the fox", "what a day"], priority=0)
    loop = run_loop(r, handler)
    results = {j.id: j.result(timeout=1) for j in jobs}
    statuses = [results[j.id].status for j in jobs]
    assert statuses == ["ok", "error", "ok", "ok"]
    assert results[jobs[1].id].error.code is ErrorCode.INFERENCE_FAILED
    assert loop.stats.batches >= 1


class Unencodable(EmbeddingRunner):
    """Returns an output the wire cannot carry (a bare object) for the text "odd one"."""

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        out = super().run(rows)
        return [object() if r.ids == self._odd else o for r, o in zip(rows, out, strict=True)]


def test_an_output_the_wire_cannot_carry_is_an_error_result(
    tiny_embedder: Path, r: redis.Redis
) -> None:
    handler = Unencodable(tiny_embedder, device=DEVICE, max_tokens=32)
    handler._odd = handler.encode(["odd one"])[0].ids  # type: ignore[attr-defined]
    producer = Producer(client=r)
    jobs = producer.submit_many(MODEL, ["the dog", "odd one", "the fox"], priority=0)
    run_loop(r, handler)
    results = [j.result(timeout=1) for j in jobs]
    assert [x.status for x in results] == ["ok", "error", "ok"]
    err = results[1].error
    assert err is not None and err.code is ErrorCode.INFERENCE_FAILED
    assert "cannot be encoded" in err.message
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def test_entry_id_time_is_the_enqueue_time() -> None:
    assert Entry(0, "1700000000123-4", {}).enqueued_ms == 1700000000123


def test_out_of_memory_splits_and_lowers_the_caps(tiny_embedder: Path, r: redis.Redis) -> None:
    from fault_handlers import FaultyEmbedder

    # Given a model that runs out of memory above 4 rows, and 96 requests queued at once
    handler = FaultyEmbedder(tiny_embedder, device=DEVICE, max_tokens=32, options={"oom_above": 4})
    producer = Producer(client=r)
    jobs = producer.submit_many(MODEL, [f"the dog {i}" for i in range(96)], priority=0)
    loop = run_loop(r, handler)
    # Then every request succeeds, the OOM was seen, and later batches fit under the limit
    results = [j.result(timeout=1) for j in jobs]
    assert all(res.ok for res in results)
    assert loop.stats.oom_events >= 1
    sizes = [res.timings.batch_size for res in results]
    assert max(sizes) > 4, "the first batch was larger than the device could take"
    assert sizes[-1] <= 8, "the engine lowered its caps"
    assert handler.largest_run <= 4


def test_dead_letters_list_replay_and_purge(r: redis.Redis, handler: EmbeddingRunner) -> None:
    from batchfleet import dlq

    # Given two dead letters: an unreadable entry, and a poison request that was answered
    streams = ModelStreams(r, MODEL, 3, "w")
    streams.ensure_groups()
    r.xadd(KEYS.lane(2), {"msgpack": b"\xc1"})
    req = Request(id="poisoned-1", model=MODEL, inputs=["the dog"])
    r.xadd(KEYS.lane(1), encode_request(req))
    entries = streams.read({1: 1, 2: 1}, None)
    for e in entries:
        streams.dead_letter(e, "poisoned", "test", "w", 100)
    r.set(KEYS.result(req.id), b"old error result")

    listed = dlq.list_dead(r, MODEL)
    assert [d.code for d in listed] == ["poisoned", "poisoned"]
    assert {d.request_id for d in listed} == {None, "poisoned-1"}

    # When replayed without force, the answered one is skipped; with force it goes back
    report = dlq.replay(r, MODEL)
    assert len(report.replayed) == 1 and len(report.skipped) == 1
    report = dlq.replay(r, MODEL, [d.id for d in dlq.list_dead(r, MODEL)], force=True)
    assert len(report.replayed) == 1 and r.get(KEYS.result(req.id)) is None
    run_loop(r, handler)
    assert result_of(r, req.id).ok, "the replayed request was computed"
    assert dlq.purge(r, MODEL) == 1  # the unreadable one, dead-lettered again
    assert r.xlen(KEYS.dead) == 0


def test_timings_of_a_request_that_arrives_during_a_blocking_read(
    r: redis.Redis, handler: EmbeddingRunner
) -> None:
    # Given a worker blocked in XREADGROUP on empty streams
    cfg = ModelConfig(path="/unused", max_tokens=32)
    loop = BatchLoop(
        MODEL, cfg, handler, r, consumer="w1", worker=WorkerConfig(block_ms=800), burst=True
    )
    thread = threading.Thread(target=loop.run)
    thread.start()
    time.sleep(0.4)
    # When a request arrives mid-block
    job = Producer(client=r).submit(MODEL, "the dog", priority=0)
    thread.join(10)
    # Then its queue time is the short wait for the read to return, not zero, and its batch
    # wait does not absorb the time the worker spent blocked before it arrived
    t = job.result(timeout=1).timings
    assert t.batch_wait_ms < 400, t  # it arrived 400 ms into the block: none of that counts
    assert t.queued_ms + t.batch_wait_ms + t.inference_ms <= t.total_ms + 1


def test_one_script_call_stores_a_whole_batch_and_keeps_the_first_result(r: redis.Redis) -> None:
    streams = ModelStreams(r, MODEL, 3, "w")
    streams.ensure_groups()
    for lane in (0, 2, 2):
        r.xadd(KEYS.lane(lane), {"msgpack": b"x"})
    entries = streams.read({0: 5, 2: 5}, None)
    assert len(entries) == 3
    r.set(KEYS.result("b"), b"stored before")  # a redelivery: b already has its result
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("c")
    items = [
        Finish(e, rid, f"r-{rid}".encode(), 60, "c") for e, rid in zip(entries, "abc", strict=True)
    ]
    assert streams.finish(items) == [True, False, True]
    assert [r.get(KEYS.result(k)) for k in "abc"] == [b"r-a", b"stored before", b"r-c"]
    got = []
    end = time.monotonic() + 2
    while len(got) < 4 and time.monotonic() < end:  # a fourth would be a wrong publish
        if (msg := pubsub.get_message(timeout=0.2)) is not None:
            got.append(msg["data"])
    # each once; for b (a second entry of an answered request) the stored result, unchanged
    assert got == [b"r-a", b"stored before", b"r-c"]
    assert [r.xlen(KEYS.lane(n)) for n in range(3)] == [0, 0, 0]  # every entry retired
    assert all(r.xpending(KEYS.lane(n), GROUP)["pending"] == 0 for n in range(3))
