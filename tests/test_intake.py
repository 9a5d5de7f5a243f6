"""The intake against a real Redis: heartbeat-based takeover of a dead worker's entries,
a live worker's long batch left alone (also requests held past ``claim_idle_ms``: their
entries are refreshed, unless a device step hangs that long), and redelivered entries of
answered requests."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.schemas.codec import decode_result, encode_request
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Limits, Request
from batchfleet.worker.holding import Holding
from batchfleet.worker.inbox import Lost, ReadIdle
from batchfleet.worker.intake import LANE0_ONLY_BLOCK_MS, Intake
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runners.embedding import EmbeddingRunner
from batchfleet.worker.streams import Entry, ModelStreams
from conftest import next_message
from fault_handlers import FaultyEmbedder

from batchfleet.config import ModelConfig, WorkerConfig

MODEL = "tiny"
KEYS = ModelKeys(MODEL)


@pytest.fixture(scope="module")
def runner(tiny_embedder: Path) -> EmbeddingRunner:
    return EmbeddingRunner(tiny_embedder, device="cpu", max_tokens=32)


def held_by(r: redis.Redis, consumer: str, req: Request, beat_age_ms: int | None) -> str:
    """Given an entry read by ``consumer``, whose last heartbeat is ``beat_age_ms`` old
    (None: it never beat)."""
    streams = ModelStreams(r, MODEL, 3, consumer)
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), encode_request(req))
    (entry,) = streams.read({0: 10}, None)
    if beat_age_ms is not None:
        sec, usec = r.time()
        streams.heartbeat(int(sec * 1000 + usec / 1000) - beat_age_ms)
    return entry.id


def run_loop(r: redis.Redis, runner: Any, **worker: Any) -> BatchLoop:
    loop = BatchLoop(MODEL, ModelConfig(max_tokens=32), runner, r, consumer="w1",
                     worker=WorkerConfig(**{"block_ms": 50, **worker}), burst=True)  # fmt: skip
    loop.run()
    return loop


def test_a_dead_workers_entries_are_taken_over_once_its_heartbeat_stops(
    r: redis.Redis, runner: EmbeddingRunner
) -> None:
    # Given a worker that read a request and stopped beating 10 s ago (kill -9)
    held_by(r, "dead", Request(id="orphan", model=MODEL, inputs=["the dog"]), 10_000)
    time.sleep(0.3)  # the entry has been idle longer than the heartbeat timeout below
    # When a live worker runs, with the idle-time fallback far away (its default)
    run_loop(r, runner, heartbeat_timeout_ms=200, block_ms=300)  # burst: 2 idle reads, 0.6 s
    # Then it took the entry over through the stale heartbeat and answered it
    res = decode_result(r.get(KEYS.result("orphan")))
    assert res.ok and res.timings.worker == "w1"
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def test_a_request_taken_over_from_a_dead_worker_is_no_longer_started(
    r: redis.Redis, runner: EmbeddingRunner
) -> None:
    # Given a request a worker admitted (its started key names it) before it died
    held_by(r, "dead", Request(id="orphan", model=MODEL, inputs=["the dog"]), 10_000)
    r.set(KEYS.started("orphan"), "dead", ex=60)
    r.set(KEYS.started("other"), "dead", ex=60)  # another request: not this entry's
    time.sleep(0.3)
    # When a live worker takes it over (an embedding loop: it never marks one started)
    run_loop(r, runner, heartbeat_timeout_ms=200, block_ms=300)
    # Then its started key went with the takeover: it waited again, not "in progress"
    assert decode_result(r.get(KEYS.result("orphan"))).ok
    assert not r.exists(KEYS.started("orphan"))
    assert r.get(KEYS.started("other")) == b"dead"


def test_a_live_workers_long_batch_is_not_taken(r: redis.Redis, runner: EmbeddingRunner) -> None:
    # Given a worker computing a request for a long time, still beating
    held_by(r, "busy", Request(id="long", model=MODEL, inputs=["the dog"]), 0)
    time.sleep(0.3)
    # When another worker runs (its entry idle past the heartbeat timeout, not the fallback)
    loop = run_loop(r, runner, heartbeat_timeout_ms=60_000)
    # Then the entry stays with its worker: not computed twice
    assert r.get(KEYS.result("long")) is None
    assert loop.stats.batches == 0
    (pending,) = r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 10)
    assert pending["consumer"] == b"busy"


def test_the_idle_fallback_takes_entries_of_a_worker_that_beats_but_is_stuck(
    r: redis.Redis, runner: EmbeddingRunner
) -> None:
    held_by(r, "stuck", Request(id="stuck-1", model=MODEL, inputs=["the dog"]), 0)
    time.sleep(0.3)
    run_loop(r, runner, heartbeat_timeout_ms=60_000, claim_idle_ms=200)
    assert decode_result(r.get(KEYS.result("stuck-1"))).ok


def read_by_w1(r: redis.Redis, n: int) -> tuple[ModelStreams, list[Entry]]:
    """``n`` entries added to lane 0 and read by consumer w1; the last one since claimed by
    w2 (as the idle fallback does)."""
    streams = ModelStreams(r, MODEL, 3, "w1")
    streams.ensure_groups()
    for i in range(n):
        r.xadd(KEYS.lane(0), encode_request(Request(id=f"e{i}", model=MODEL, inputs=["x"])))
    entries = streams.read({0: 10}, None)
    r.xclaim(KEYS.lane(0), GROUP, "w2", 0, [entries[-1].id], justid=True)
    return streams, entries


def test_refreshing_resets_the_idle_time_of_own_pending_entries_and_counts_no_delivery(
    r: redis.Redis,
) -> None:
    # Given three entries read by w1: one still pending on it, one acked, one taken by w2
    streams, (mine, acked, taken) = read_by_w1(r, 3)
    r.xack(KEYS.lane(0), GROUP, acked.id)
    time.sleep(0.5)
    # When w1 refreshes all three
    assert streams.refresh([mine, acked, taken]) == (1, [taken])
    # Then its own is fresh again and still delivered once; the others are left alone (the
    # one taken over reported, so w1 drops it)
    pending = {
        p["message_id"].decode(): p for p in r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 9)
    }
    assert set(pending) == {mine.id, taken.id}
    assert pending[mine.id]["consumer"] == b"w1" and pending[mine.id]["times_delivered"] == 1
    assert pending[mine.id]["time_since_delivered"] < 250
    assert pending[taken.id]["consumer"] == b"w2" and pending[taken.id]["times_delivered"] == 1
    assert pending[taken.id]["time_since_delivered"] >= 500


def watch_reclaims(r: redis.Redis, loop: BatchLoop) -> tuple[list[Entry], set[int]]:
    """Run ``loop`` while another worker (w2) looks for idle entries to take over every
    100 ms: what it took, and the delivery counts seen."""
    other = ModelStreams(r, MODEL, 3, "w2")
    other.ensure_groups()  # as the loop's start does: its thread may not be there yet
    thread = threading.Thread(target=loop.run)
    thread.start()
    taken: list[Entry] = []
    deliveries: set[int] = set()
    while thread.is_alive():
        taken += other.reclaim(loop.worker.claim_idle_ms, 10, suspects=True, lock_ms=100)
        deliveries |= {
            p["times_delivered"] for p in r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 99)
        }
        time.sleep(0.1)
    thread.join()
    return taken, deliveries


def test_a_live_workers_requests_held_past_claim_idle_ms_are_not_taken(
    r: redis.Redis, tiny_embedder: Path
) -> None:
    # Given a worker computing 10 requests one at a time, 150 ms each, with the idle
    # fallback at 500 ms: the last waits about 1.35 s
    for i in range(10):
        r.xadd(KEYS.lane(0), encode_request(Request(id=f"q{i}", model=MODEL, inputs=["the dog"])))
    slow = FaultyEmbedder(tiny_embedder, device="cpu", max_tokens=32, options={"batch_ms": 150})
    cfg = ModelConfig(max_tokens=32, batch={"max_batch_size": 1})
    loop = BatchLoop(MODEL, cfg, slow, r, consumer="w1", burst=True,
                     worker=WorkerConfig(block_ms=50, claim_idle_ms=500))  # fmt: skip
    # When another worker looks for entries to take over all the while
    taken, deliveries = watch_reclaims(r, loop)
    # Then it never found one idle: each delivered once, answered by its worker
    assert taken == [] and deliveries <= {1}
    assert {decode_result(r.get(KEYS.result(f"q{i}"))).timings.worker for i in range(10)} == {"w1"}


def test_a_device_step_hung_past_claim_idle_ms_lets_the_idle_fallback_take_its_requests(
    r: redis.Redis, tiny_embedder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a worker whose device takes 4 s over one request, with the idle fallback at 400 ms
    # (the worker's own reclaims hold the model's reclaim lock for 2 s at a time: the other
    # worker gets its turn well before the step ends, even on a loaded machine)
    hung = r.xadd(KEYS.lane(0), encode_request(Request(id="hung", model=MODEL, inputs=["a b"])))
    slow = FaultyEmbedder(tiny_embedder, device="cpu", max_tokens=32, options={"batch_ms": 4000})
    loop = BatchLoop(MODEL, ModelConfig(max_tokens=32), slow, r, consumer="w1", burst=True,
                     worker=WorkerConfig(block_ms=50, claim_idle_ms=400))  # fmt: skip
    # When another worker looks for entries to take over all the while
    with caplog.at_level(logging.WARNING, logger="batchfleet.worker.intake"):
        taken, _ = watch_reclaims(r, loop)
    # Then its refresh stopped: the request was taken (as before live workers refreshed)
    assert taken and {e.id for e in taken} == {hung.decode()}
    # and said so (once per hung step: tests the clock-driven case below; here the taken
    # entry can come back to this worker and hang a second step)
    warned = [m for m in caplog.messages if "no longer refreshing" in m]
    assert warned and all("its 1 held requests" in m for m in warned), caplog.messages


def test_the_refresh_is_withheld_while_a_step_hangs_and_the_warning_comes_once(
    r: redis.Redis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an intake (not started; a clock in our hands) whose loop holds one entry
    now = [100.0]
    streams = ModelStreams(r, MODEL, 3, "w1")
    refreshed: list[tuple[float, tuple[Entry, ...]]] = []
    monkeypatch.setattr(
        streams, "refresh", lambda entries: (refreshed.append((now[0], entries)), (0, []))[1]
    )
    intake = Intake(streams, WorkerConfig(claim_idle_ms=1000), Limits(), lambda: now[0], print)
    entry = Entry(0, "1-0", {})

    def refresh_at(t: float, busy_since: float | None) -> None:
        now[0] = t
        intake.hold(Holding((entry,), busy_since))
        intake._refresh()

    # When a step starts at 100 s and hangs; later a step starts at 103 s and hangs again
    with caplog.at_level(logging.WARNING, logger="batchfleet.worker.intake"):
        for t in (100.0, 100.5, 101.1, 101.5, 102.0):
            refresh_at(t, 100.0)
        for t in (103.0, 103.5, 104.5):
            refresh_at(t, 103.0)
    # Then refreshes stop past 1 s into each, with one warning each time
    assert [t for t, _ in refreshed] == [100.0, 100.5, 103.0, 103.5]
    assert len([m for m in caplog.messages if "no longer refreshing" in m]) == 2


def test_the_intake_tells_its_loop_of_held_requests_taken_over_by_another_worker(
    r: redis.Redis,
) -> None:
    # Given an intake whose loop holds two entries, one since claimed by w2 (this worker
    # stalled past claim_idle_ms; the idle fallback gave it away)
    streams, (mine, taken) = read_by_w1(r, 2)
    posted: list[Any] = []
    intake = Intake(streams, WorkerConfig(), Limits(), time.monotonic, posted.append)
    intake.hold(Holding((mine, taken)))
    # When it refreshes them
    intake._refresh()
    # Then the loop is told of the one taken over, and only its own stays pending on it
    assert posted == [Lost((taken,))]
    owners = {p["message_id"].decode(): p["consumer"]
              for p in r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 9)}  # fmt: skip
    assert owners == {mine.id: b"w1", taken.id: b"w2"}


def test_a_redelivered_entry_of_an_answered_request_republishes_the_stored_result(
    r: redis.Redis, runner: EmbeddingRunner
) -> None:
    # Given a request answered already, whose entry is pending on a dead worker
    req = Request(id="answered", model=MODEL, inputs=["the dog"], reply="chan")
    held_by(r, "dead", req, 10_000)
    r.set(KEYS.result(req.id), b"the first result stands")
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("chan")
    time.sleep(0.3)
    loop = run_loop(r, runner, heartbeat_timeout_ms=200, block_ms=300)
    # Then it is not computed again; the stored result is published again and stands
    assert loop.stats.batches == 0
    assert r.get(KEYS.result(req.id)) == b"the first result stands"
    msg = next_message(pubsub)
    assert msg is not None and msg["data"] == b"the first result stands"
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def test_a_second_entry_with_an_answered_id_gets_the_stored_result_on_its_channel(
    r: redis.Redis, runner: EmbeddingRunner
) -> None:
    # Given a request answered, then submitted again under the same id (a producer retry)
    first = Request(id="twice", model=MODEL, inputs=["the dog"], reply="chan-1")
    r.xadd(KEYS.lane(1), encode_request(first))
    run_loop(r, runner)
    stored = r.get(KEYS.result("twice"))
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("chan-2")
    again = Request(id="twice", model=MODEL, inputs=["the cat"], reply="chan-2")
    r.xadd(KEYS.lane(1), encode_request(again))
    run_loop(r, runner)
    # Then the subscriber of the second gets the first result; the stored one never changes
    msg = next_message(pubsub)
    assert msg is not None and msg["data"] == stored
    assert r.get(KEYS.result("twice")) == stored
    assert r.xlen(KEYS.lane(1)) == 0


def test_handing_entries_back_does_not_count_a_delivery(r: redis.Redis) -> None:
    # Given an entry handed back three times (three graceful restarts, say)
    streams = ModelStreams(r, MODEL, 3, "w1")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), encode_request(Request(id="calm", model=MODEL, inputs=["x"])))
    (entry,) = streams.read({0: 1}, None)
    successor = ModelStreams(r, MODEL, 3, "w2")  # (one reclaimer: the reclaim lock is its)
    for holder in (streams, successor, successor):
        holder.release([entry], idle_ms=10)
        time.sleep(0.02)
        (entry,) = successor.reclaim(10, 10, suspects=True)
    # Then it is still on its first delivery: not a suspect, never poisoned for it
    assert entry.deliveries == 1


def test_a_worker_restarted_under_its_name_answers_what_its_previous_life_held(
    r: redis.Redis, runner: EmbeddingRunner
) -> None:
    # Given a worker "w1" that read a request and was killed; it comes back as "w1" at once
    held_by(r, "w1", Request(id="mine", model=MODEL, inputs=["the dog"]), 0)
    # When it runs (its fresh heartbeat makes the entry look held by a live worker)
    run_loop(r, runner)
    # Then it took its own pending entry again and answered it
    assert decode_result(r.get(KEYS.result("mine"))).ok
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def test_a_redis_clock_read_never_touches_redis() -> None:
    from batchfleet.worker.redis_clock import RedisClock

    class Counting:
        calls = 0

        def redis_time(self) -> float:
            Counting.calls += 1
            return 2_000_000_000.0

    clock = RedisClock(Counting())  # type: ignore[arg-type]
    for _ in range(100):
        clock()
    assert Counting.calls == 0
    clock.sync()
    assert Counting.calls == 1 and abs(clock() - 2_000_000_000.0) < 1.0
    clock.sync()  # not due yet
    assert Counting.calls == 1


def test_finish_retried_after_a_lost_reply_is_its_own_write(r: redis.Redis) -> None:
    from batchfleet.worker.streams import Finish

    streams = ModelStreams(r, MODEL, 3, "w")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    (entry,) = streams.read({0: 1}, None)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("c")
    item = Finish(entry, "rid", b"payload", 60, "c")
    assert streams.finish([item]) == [True]
    assert streams.finish([item]) == [True], "the same payload again: our own write"
    assert next_message(pubsub, 2)["data"] == b"payload"
    assert next_message(pubsub, 1) is None, "published once"


def test_a_generation_attempt_taken_over_stores_nothing_and_its_heir_answers(
    r: redis.Redis,
) -> None:
    from batchfleet.worker.streams import DUPLICATE, STORED, SUPERSEDED, Finish
    from batchfleet.worker.token_stream import TokenWrite

    # Given a generation request read by w1, then taken over by w2 (the idle fallback)
    # while w1 stalled; w1 resumes and finishes its attempt (life 1) first
    first = ModelStreams(r, MODEL, 3, "w1")
    first.ensure_groups()
    heir = ModelStreams(r, MODEL, 3, "w2")
    r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    (entry,) = first.read({0: 1}, None)
    r.xclaim(KEYS.lane(0), GROUP, "w2", 0, [entry.id])
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("c")
    tokens = KEYS.tokens("rid")

    def attempt(payload: bytes, life: int, seq: int) -> Finish:
        end = TokenWrite("rid", seq, 60, life=-life)  # as the loop builds it: checked
        return Finish(entry, "rid", payload, 60, "c", fenced=True, end=end)

    # Then w1 writes nothing: no result, no stream end, no message, and the entry stays
    # pending on w2
    assert first.finish([attempt(b"first", 1, 4)]) == [SUPERSEDED]
    assert r.get(KEYS.result("rid")) is None and r.xlen(tokens) == 0
    (pending,) = r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 10)
    assert pending["consumer"] == b"w2"
    assert next_message(pubsub, 0.5) is None
    # And the heir stores its result with its stream's end, in one step, and acks
    assert heir.finish([attempt(b"second", 2, 2)]) == [STORED]
    assert r.get(KEYS.result("rid")) == b"second"
    ((_, end),) = r.xrange(tokens)
    assert end == {b"life": b"2", b"seq": b"2", b"end": b"1"} and 0 < r.ttl(tokens) <= 60
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0
    assert next_message(pubsub, 2)["data"] == b"second"
    # Once the heir has answered, w1 is still behind it (the stream's last entry is the
    # heir's); an attempt that did not stream finds the heir's result, which stands
    assert first.finish([attempt(b"first", 1, 4)]) == [SUPERSEDED]
    plain = Finish(entry, "rid", b"first", 60, "c", fenced=True)
    assert first.finish([plain]) == [DUPLICATE]
    assert r.get(KEYS.result("rid")) == b"second" and r.xlen(tokens) == 1
    assert next_message(pubsub, 2)["data"] == b"second", "published again for w1's entry"
    assert heir.finish([attempt(b"second", 2, 2)]) == [STORED], "a retry: its own write"
    assert r.xlen(tokens) == 1, "a retried call appends no second end"


def test_a_generation_attempt_behind_a_later_one_in_its_token_stream_stores_nothing(
    r: redis.Redis,
) -> None:
    from batchfleet.worker.streams import STORED, SUPERSEDED, Finish
    from batchfleet.worker.token_stream import TokenWrite

    # Given an entry pending on this worker (life 1), whose token stream a later attempt
    # (life 2) has written to meanwhile
    streams = ModelStreams(r, MODEL, 3, "w1")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    r.xadd(KEYS.lane(0), {"msgpack": b"y"})
    one, two = streams.read({0: 2}, None)
    r.xadd(KEYS.tokens("a"), {"life": 2, "seq": 1, "input": 0, "text": "A", "tokens": 1})
    end = TokenWrite("a", 3, 60, life=-1)
    # Then its streamed attempt stores nothing
    assert streams.finish([Finish(one, "a", b"1", 60, None, True, end)]) == [SUPERSEDED]
    assert r.get(KEYS.result("a")) is None and r.xlen(KEYS.tokens("a")) == 1
    # While an attempt that does not stream is checked by its entry alone, and an encoder's
    # result (not fenced) by nothing: first result stands
    assert streams.finish([Finish(two, "b", b"2", 60, None, True)]) == [STORED]
    assert not r.exists(KEYS.tokens("b"))
    assert streams.finish([Finish(one, "c", b"3", 60, None)]) == [STORED]


def test_results_wait_out_a_redis_that_refuses_writes(r: redis.Redis) -> None:
    from batchfleet.worker.answers import Outgoing
    from batchfleet.worker.observers import Observers
    from batchfleet.worker.sink import RedisSink
    from test_sink import outgoing

    # Given a Redis out of memory (noeviction: writes refused with OOM)
    streams = ModelStreams(r, MODEL, 3, "w")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    (entry,) = streams.read({0: 1}, None)
    sink = RedisSink(streams, Observers(), lambda: None, dead_letter_maxlen=10)
    sink.start()
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")
    try:
        out: Outgoing = outgoing(entry, "oom-1")
        sink.send([out])
        time.sleep(0.3)
        assert r.get(KEYS.result("oom-1")) is None and sink.backlog == 1
    finally:
        r.config_set("maxmemory", "0")
    # Then once it can write again, the result is stored (not dropped)
    sink.close(10)
    assert decode_result(r.get(KEYS.result("oom-1"))).ok
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def test_a_server_that_lost_its_data_gets_its_groups_back(
    r: redis.Redis, runner: EmbeddingRunner
) -> None:
    import threading

    loop = BatchLoop(MODEL, ModelConfig(max_tokens=32), runner, r, consumer="w1",
                     worker=WorkerConfig(block_ms=50))  # fmt: skip
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        while not r.hexists(KEYS.workers, "w1"):
            time.sleep(0.02)
        r.flushall()  # like a restart without persistence: streams and groups are gone
        r.xadd(KEYS.lane(0), encode_request(Request(id="after", model=MODEL, inputs=["x"])))
        end = time.monotonic() + 30
        while r.get(KEYS.result("after")) is None and time.monotonic() < end:
            time.sleep(0.05)
        assert decode_result(r.get(KEYS.result("after"))).ok
    finally:
        loop.stop()
        thread.join(10)


def test_a_grant_of_lane_0_alone_blocks_briefly(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an intake (not started) of a 3-lane model, its reads recorded, nothing queued
    streams = ModelStreams(r, MODEL, 3, "w1")
    streams.ensure_groups(None)
    blocks: list[int | None] = []
    monkeypatch.setattr(
        streams, "read", lambda counts, block_ms, idle=False: blocks.append(block_ms) or []
    )
    intake = Intake(streams, WorkerConfig(block_ms=1000), Limits(), time.monotonic, print)
    intake._takeover.judged = True  # no takeover pass first
    intake._takeover.last = time.monotonic()
    # When the loop grants every lane, then lane 0 alone (its reserve, the hold full)
    intake._read({0: 2, 1: 3, 2: 1}, True)
    intake._read({0: 2}, True)
    # Then the second read blocks no longer than LANE0_ONLY_BLOCK_MS, so a grant for the
    # other lanes made meanwhile is served soon
    assert blocks == [1000, LANE0_ONLY_BLOCK_MS]


def clocked_intake(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch, worker: WorkerConfig
) -> tuple[Intake, list[float], list[float]]:
    """An intake not started, its clock (``now[0]``) in the test's hands, whose heartbeats
    go nowhere and whose refreshes are recorded (when)."""
    now = [100.0]
    streams = ModelStreams(r, MODEL, 3, "w1")
    refreshed: list[float] = []
    monkeypatch.setattr(streams, "heartbeat", lambda ms: None)
    monkeypatch.setattr(streams, "refresh", lambda entries: (refreshed.append(now[0]), (0, []))[1])
    return Intake(streams, worker, Limits(), lambda: now[0], print), now, refreshed


def test_after_a_silence_past_the_heartbeat_timeout_the_intake_refreshes_at_once(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an intake (a clock in our hands) holding one entry, refreshed every 60 s
    worker = WorkerConfig(claim_idle_ms=300_000, heartbeat_timeout_ms=6000)
    intake, now, refreshed = clocked_intake(r, monkeypatch, worker)
    intake.hold(Holding((Entry(0, "1-0", {}),)))
    # When it beats every second, then goes silent for 10 s (the process stalled)
    suspect: dict[float, bool] = {}
    for t in (100.0, 101.0, 102.0, 111.9, *(112.0 + k for k in range(11)), 122.5):
        now[0] = t
        if t != 111.9:  # (asleep at 111.9)
            intake._beat()
            intake._refresh()
        suspect[t] = intake.suspect()
    # Then it refreshed when it started, and again as soon as it woke, not 60 s later; its
    # token writes are checked in the grace after its first beat, through the silence, and
    # for SUSPECT_GRACE_S after it
    assert refreshed == [100.0, 112.0]
    assert [t for t, s in suspect.items() if not s] == [122.0, 122.5]


def test_when_a_hung_step_ends_the_intake_refreshes_at_once_and_checks_token_writes(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an intake beating every second, refreshing every 10 s, whose loop's device step
    # starts at 100 s and hangs past claim_idle_ms (40 s) until 155 s
    intake, now, refreshed = clocked_intake(r, monkeypatch, WorkerConfig(claim_idle_ms=40_000))
    intake._beat_ok = 99.0  # (started and beating)
    entry = Entry(0, "1-0", {})
    intake.hold(Holding((entry,), 100.0))
    suspect: dict[float, bool] = {}
    for k in range(71):
        now[0] = 100.0 + k
        if now[0] == 155.0:  # the step ends; the next one starts at once
            intake.hold(Holding((entry,), 155.0))
        intake._beat()
        intake._refresh()
        suspect[now[0]] = intake.suspect()
    # Then refreshes stop once it hangs (150 s), and come again the moment it ends (not at
    # the next 10 s mark); token writes are checked while it hangs and SUSPECT_GRACE_S after
    assert refreshed == [100.0, 110.0, 120.0, 130.0, 140.0, 155.0, 165.0]
    assert [t for t, s in suspect.items() if s] == [150.0 + k for k in range(15)]


def idle_intake(r: redis.Redis) -> tuple[Intake, list[Any]]:
    """An intake (not started) of a 3-lane model, nothing queued, no takeover pass due,
    blocking 1 ms; and what it posts to its loop."""
    streams = ModelStreams(r, MODEL, 3, "w1")
    streams.ensure_groups(None)
    posted: list[Any] = []
    intake = Intake(streams, WorkerConfig(block_ms=1), Limits(), time.monotonic, posted.append)
    intake._takeover.judged = True  # no takeover pass first
    intake._takeover.last = time.monotonic()
    return intake, posted


def test_a_saturated_loop_is_told_of_two_empty_reads_in_a_row_then_only_once_it_holds_none(
    r: redis.Redis,
) -> None:
    # Given an intake (not started) whose loop holds a request, nothing queued
    intake, posted = idle_intake(r)
    intake.hold(Holding((Entry(1, "1-0", {}),)))

    def idle_reads(n: int) -> int:
        posted.clear()
        for _ in range(n):
            intake._read({0: 8}, True)
        return sum(isinstance(e, ReadIdle) for e in posted)

    # When it reads an empty lane 0 five times (the reserve of a full hold)
    # Then the loop hears of the first two only (a burst loop's stop needs two)
    assert idle_reads(5) == 2
    # And once a read delivers, the next two empty ones are told again
    r.xadd(KEYS.lane(0), encode_request(Request(id="a", model=MODEL, inputs=["x"])))
    intake._read({0: 8}, True)
    assert idle_reads(3) == 2
    # And once the loop holds nothing, every empty read is told
    intake.hold(Holding(()))
    assert idle_reads(3) == 3


def test_a_blocking_read_of_one_lane_is_one_command(r: redis.Redis) -> None:
    # Given lane 0 empty, then three requests in it
    streams = ModelStreams(r, MODEL, 3, "w1")
    streams.ensure_groups(None)
    r.config_resetstat()
    # When one lane is read with a block, empty and then full
    assert streams.read({0: 8}, 1) == []
    for k in range(3):
        r.xadd(KEYS.lane(0), {"msgpack": f"{k}".encode()})
    got = streams.read({0: 2}, 1000)
    # Then the first two came at once, in order, each read one XREADGROUP
    assert [e.fields[b"msgpack"] for e in got] == [b"0", b"1"]
    assert r.info("commandstats")["cmdstat_xreadgroup"]["calls"] == 2


def test_an_idle_grant_read_again_blocks_at_once_until_a_read_delivers(r: redis.Redis) -> None:
    # Given an intake (not started) of a 3-lane model granted two lanes, nothing queued
    intake, posted = idle_intake(r)
    grant = {1: 2, 2: 3}

    def xreadgroups(reads: list[dict[int, int]]) -> int:
        r.config_resetstat()
        for counts in reads:
            intake._read(counts, True)
        return int(r.info("commandstats")["cmdstat_xreadgroup"]["calls"])

    # When it reads the grant three times: the first looks at each lane, then blocks
    # Then the next two only block (one command each: the wait goes on)
    assert xreadgroups([grant]) == 3
    assert xreadgroups([grant, grant]) == 2
    # And another grant looks first again
    assert xreadgroups([{1: 1, 2: 3}]) == 3
    # And with three requests queued in lane 1, a read looks first: lane 1's own count
    for k in range(3):
        r.xadd(KEYS.lane(1), encode_request(Request(id=f"a{k}", model=MODEL, inputs=["x"])))
    posted.clear()
    assert xreadgroups([grant]) == 2
    assert [e.lane for e in posted[0].entries] == [1, 1]
    # And after a read that delivered, the next looks first again (the third request),
    # and only a read that blocked and found nothing lets the next block at once
    assert xreadgroups([grant]) == 2
    assert xreadgroups([grant]) == 3
    assert xreadgroups([grant]) == 1
