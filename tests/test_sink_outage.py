"""The Redis sink across a lost answer and a Redis kill -9, the stream's end written with
its result (``finish.lua``), as a generating worker writes it: deltas sent at once from
the device thread, the next step's deltas handed over behind a failed write, the result
after them. Whatever Redis ran before it died, each stream holds every ``seq`` once, in
order, then its end (the gap ``bench.gen_chaos`` once saw: ``end seq 69 after 67
deltas``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Request, Result, Timings
from batchfleet.worker.answers import Outgoing
from batchfleet.worker.observers import Observers
from batchfleet.worker.sink import RedisSink
from batchfleet.worker.streamed import Streamed
from batchfleet.worker.streams import Entry, ModelStreams
from batchfleet.worker.token_writes import Sent

from batchfleet.redis_server import LocalRedis

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"
KEYS = ModelKeys(MODEL)


def delta(rid: str, seq: int, life: int = 1) -> Streamed:
    return Streamed(rid, seq, f"t{seq}", 60, None, "msgpack", tokens=1, model="m", life=life)


def result(entry: Entry, rid: str, end_seq: int) -> Outgoing:
    """The generation's result, its stream's end (``end_seq``) written with it."""
    req = Request(id=rid, model=MODEL, inputs=["x"])
    res = Result.model_construct(id=rid, model=MODEL, status="ok", outputs=[[1.0]],
                                 metadata={}, timings=Timings(), finished_at_ms=1)  # fmt: skip
    end = Streamed(rid, end_seq, None, 60, None, "msgpack", life=-entry.deliveries).write()
    return Outgoing(entry, req, res, "msgpack", 60, None, fenced=True, end=end)


def layout(r: redis.Redis, rid: str) -> list[tuple[int, bool]]:
    """(seq, is the end) of each entry of ``rid``'s token stream."""
    return [(int(f[b"seq"]), b"end" in f) for _, f in r.xrange(KEYS.tokens(rid))]


def entries(streams: ModelStreams, r: redis.Redis, n: int) -> list[Entry]:
    streams.ensure_groups()
    for _ in range(n):
        r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    return streams.read({0: n}, None)


@pytest.fixture
def aof_redis() -> Iterator[LocalRedis]:
    server = LocalRedis(appendonly=True, appendfsync="always")
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("ran", [True, False], ids=["ran", "not-run"])
@pytest.mark.parametrize("reader", ["next-step", "writer"])
def test_a_lost_answer_before_the_result_keeps_every_seq_once_then_the_end(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch, ran: bool, reader: str
) -> None:
    # Given deltas 1-3 of "g" written, and delta 4 (with "h"'s 1) sent at once whose
    # answer is lost after Redis ran the call (``ran``) or before it did
    streams = ModelStreams(r, MODEL, 3, "w")
    (entry,) = entries(streams, r, 1)
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)
    sink.stream_now([delta("g", 1), delta("g", 2), delta("g", 3)])
    sink.settle()
    send, receive = sink._direct.send, sink._direct.receive
    lost: list[str] = []

    def lost_once(sent: Sent) -> None:
        receive(sent)  # (nothing to read where nothing was sent)
        if not lost:
            lost.append(threading.current_thread().name)
            raise redis.ConnectionError("Connection closed by server.")

    if not ran:
        monkeypatch.setattr(sink._direct, "send", lambda items: Sent(()))
    monkeypatch.setattr(sink._direct, "receive", lost_once)
    sink.stream_now([delta("g", 4), delta("h", 1)])
    monkeypatch.setattr(sink._direct, "send", send)
    # When the loop hands over "g"'s result (its end numbered 5 or, after a next step's
    # deltas, 6): the lost answer is read by the next step's write (its deltas queued
    # behind the lost ones) or by the writer thread before the result
    end = 5
    if reader == "next-step":
        sink.stream_now([delta("g", 5), delta("h", 2)])
        end = 6
    sink.send([result(entry, "g", end)])
    sink.start()
    sink.close(10)
    assert lost == ["MainThread" if reader == "next-step" else "sink"]
    # Then every seq is there once, in order, then the end
    assert layout(r, "g") == [*((s, False) for s in range(1, end)), (end, True)]
    assert layout(r, "h") == [(s, False) for s in range(1, end - 3)]


def test_a_redis_kill_between_steps_loses_no_delta_before_the_end(
    aof_redis: LocalRedis,
) -> None:
    # Given a Redis with appendfsync always, a request read, its deltas 1-3 written and
    # delta 4 sent at once, its answer not read
    r = redis.Redis.from_url(aof_redis.url, socket_timeout=5)
    streams = ModelStreams(r, MODEL, 3, "w")
    first, other = entries(streams, r, 2)
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)
    sink.stream_now([delta("g", 1), delta("g", 2), delta("g", 3)])
    sink.settle()
    sink.stream_now([delta("g", 4)])
    # When Redis is killed (whether it ran the call or not), the next step's deltas are
    # handed over, another request's result and then "g"'s, with its end numbered 6; the
    # writer thread retries them until Redis is back
    aof_redis.crash()
    sink.stream_now([delta("g", 5)])
    sink.send([replace(result(other, "o", 1), end=None)])
    sink.send([result(first, "g", 6)])
    sink.start()
    aof_redis.start()
    sink.close(30)
    # Then the stream holds 1-5 once each, then its end; both results stored
    assert layout(r, "g") == [(1, False), (2, False), (3, False), (4, False), (5, False),
                              (6, True)]  # fmt: skip
    assert r.exists(KEYS.result("g"), KEYS.result("o")) == 2
    r.close()
