"""A worker's threads end when told to, wherever the stop lands: one that came while a
Redis call failed is not waited out (the intake's retry pause, the result writer's backoff
against a Redis that cannot write). Each retry pause is made an hour here, so a stop that
were missed would hang the test (its thread joined with a guard) instead of passing late."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Limits
from batchfleet.worker import intake as intake_module
from batchfleet.worker import sink as sink_module
from batchfleet.worker.intake import Intake
from batchfleet.worker.observers import Observers
from batchfleet.worker.sink import RedisSink
from batchfleet.worker.streams import ModelStreams
from test_sink import outgoing

from batchfleet.config import WorkerConfig

MODEL = "tiny"
KEYS = ModelKeys(MODEL)
HOUR = 3600.0
HANG_GUARD_S = 60.0


@pytest.mark.parametrize(
    "failure",
    [redis.ConnectionError("gone"), redis.ResponseError("ERR busy"), RuntimeError("bug")],
    ids=lambda e: type(e).__name__,
)
def test_an_intake_stopped_while_a_redis_call_fails_ends_without_its_retry_pause(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    # Given an intake whose heartbeat fails, and a stop that lands while that call runs
    monkeypatch.setattr(intake_module, "RETRY_FIRST_S", HOUR)
    monkeypatch.setattr(intake_module, "ERROR_PAUSE_S", HOUR)
    streams = ModelStreams(r, MODEL, 1, "w1")
    intake = Intake(streams, WorkerConfig(), Limits(), time.monotonic, lambda event: None)
    beats: list[int] = []

    def failing_beat(now_ms: int) -> None:
        beats.append(now_ms)
        intake.stop()
        raise failure

    monkeypatch.setattr(streams, "heartbeat", failing_beat)
    # When its thread runs
    thread = threading.Thread(target=intake._run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    # Then it ended after that one call, its pause not waited
    assert not thread.is_alive()
    assert len(beats) == 1


def test_a_result_writer_retrying_against_redis_ends_when_the_sink_closes(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a sink whose writer thread retries a result Redis cannot take (connection lost),
    # now in its backoff
    monkeypatch.setattr(sink_module, "RETRY_FIRST_S", HOUR)
    streams = ModelStreams(r, MODEL, 1, "w")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    (entry,) = streams.read({0: 1}, None)
    tries: list[int] = []
    tried = threading.Event()

    def unreachable(items: object) -> list[int]:
        tries.append(len(tries))
        tried.set()
        raise redis.ConnectionError("gone")

    monkeypatch.setattr(streams, "finish", unreachable)
    sink = RedisSink(streams, Observers(), lambda: None, dead_letter_maxlen=10)
    sink.start()
    sink.send([outgoing(entry, "r1")])
    assert tried.wait(HANG_GUARD_S)
    # When the sink is closed, its grace for pending writes spent (0 s)
    sink.close(0)
    sink._thread.join(HANG_GUARD_S)
    # Then the writer made one last try and ended: the result given up, nothing hangs
    assert not sink._thread.is_alive()
    assert len(tries) == 2
    assert sink.backlog == 0
