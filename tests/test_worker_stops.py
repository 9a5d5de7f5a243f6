"""A worker's threads end when told to, wherever the stop lands: one that came while a
Redis call failed is not waited out (the intake's retry pause, the result writer's backoff
against a Redis that cannot write). Each retry pause is made an hour here, so a stop that
were missed would hang the test (its thread joined with a guard) instead of passing late."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import decode_result
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Limits
from batchfleet.worker import intake as intake_module
from batchfleet.worker import sink as sink_module
from batchfleet.worker.app import BatchLoopStep
from batchfleet.worker.cancels import CancelWatch
from batchfleet.worker.inbox import Cancel, Event
from batchfleet.worker.intake import Intake
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.observers import Observers
from batchfleet.worker.runner import StepReport, Work
from batchfleet.worker.runners.embedding import EmbeddingRunner
from batchfleet.worker.sink import RedisSink
from batchfleet.worker.streams import ModelStreams
from test_sink import outgoing

from batchfleet.config import ModelConfig, WorkerConfig

MODEL = "tiny"
KEYS = ModelKeys(MODEL)
HOUR = 3600.0
HANG_GUARD_S = 60.0
CLAIM_IDLE_MS = 600_000
"""Long: a request handed back is marked idle this long; one merely left pending is not."""
UNREACHABLE_CLUSTER = redis.exceptions.RedisClusterUnreachableError(
    "Redis Cluster cannot be connected. Please provide at least one reachable node"
)
"""What redis-py's cluster client raises once no node answers: not a ``redis.RedisError``."""


@pytest.mark.parametrize(
    ("failure", "outage"),
    [
        (redis.ConnectionError("gone"), True),
        (UNREACHABLE_CLUSTER, True),
        (redis.ResponseError("ERR busy"), False),
        (RuntimeError("bug"), False),
    ],
    ids=lambda v: type(v).__name__,
)
def test_an_intake_stopped_while_a_redis_call_fails_ends_without_its_retry_pause(
    r: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failure: Exception,
    outage: bool,
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
    # Then it ended after that one call, its pause not waited; an unreachable Redis (a
    # cluster's too) is an outage, retried with its backoff, not logged as a bug
    assert not thread.is_alive()
    assert len(beats) == 1
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert (not errors) == outage


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


def test_a_cancel_watcher_goes_on_watching_after_a_cluster_outage(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a request a client cancelled, and a cancel watcher whose first poll meets a
    # cluster none of whose nodes answer
    streams = ModelStreams(r, MODEL, 1, "w1")
    r.set(KEYS.cancel("g1"), 1)
    posted: list[Event] = []
    heard = threading.Event()

    def post(event: Event) -> None:
        posted.append(event)
        heard.set()

    watch = CancelWatch(streams, post, every_s=0.0)
    polls: list[int] = []
    poll = watch._poll.cancelled

    def after_an_outage(request_ids: list[str]) -> list[str]:
        polls.append(len(polls))
        if len(polls) == 1:
            raise UNREACHABLE_CLUSTER
        return poll(request_ids)

    monkeypatch.setattr(watch._poll, "cancelled", after_an_outage)
    # When it watches the request
    watch.watch(["g1"])
    watch.start()
    try:
        assert heard.wait(HANG_GUARD_S)
    finally:
        watch.stop()
    # Then the poll after the outage saw the cancel, and the loop heard of it
    assert posted == [Cancel(("g1",))]


def test_a_loop_whose_cluster_is_unreachable_at_its_end_still_ends_stopped(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch, tiny_embedder: Path
) -> None:
    # Given a burst loop over empty streams, whose cluster is gone by the time it ends
    runner = EmbeddingRunner(tiny_embedder, device="cpu", max_tokens=32)
    loop = BatchLoop(MODEL, ModelConfig(max_tokens=32), runner, r, consumer="w1",
                     worker=WorkerConfig(block_ms=50), burst=True)  # fmt: skip
    assert loop.streams is not None

    def unreachable() -> None:
        raise UNREACHABLE_CLUSTER

    monkeypatch.setattr(loop.streams, "unregister", unreachable)
    # When it runs to its end
    loop.run()
    # Then it ended as stopped (its sink closed, a drain's wait for it over), not crashed
    assert loop.wait_stopped(0)


def test_a_result_is_kept_through_a_cluster_outage(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a sink whose first write meets a cluster none of whose nodes answer
    streams = ModelStreams(r, MODEL, 1, "w")
    streams.ensure_groups()
    r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    (entry,) = streams.read({0: 1}, None)
    finish = streams.finish
    tries: list[int] = []

    def after_an_outage(items: Any) -> list[int]:
        tries.append(len(tries))
        if len(tries) == 1:
            raise UNREACHABLE_CLUSTER
        return finish(items)

    monkeypatch.setattr(streams, "finish", after_an_outage)
    sink = RedisSink(streams, Observers(), lambda: None, dead_letter_maxlen=10)
    sink.start()
    # When it is given a result, then closed
    sink.send([outgoing(entry, "r1")])
    sink.close(HANG_GUARD_S)
    # Then the result was written once the cluster answered again, not handed back
    assert len(tries) == 2
    assert decode_result(r.get(KEYS.result("r1"))).ok
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


class Stuck(EmbeddingRunner):
    """Its steps never end until ``go`` is set (a hung device); ``running`` once one began."""

    running: threading.Event
    go: threading.Event

    def step(self, work: Work) -> StepReport:
        self.running.set()
        self.go.wait()
        return super().step(work)


def test_a_terminated_loop_step_hands_its_running_batch_back_at_once(
    r: redis.Redis, tiny_embedder: Path
) -> None:
    # Given the worker's loop step serving a loop whose device step never ends, with an
    # hour's shutdown grace (a warm stop would wait it out)
    runner = Stuck(tiny_embedder, device="cpu", max_tokens=32)
    runner.running, runner.go = threading.Event(), threading.Event()
    loop = BatchLoop(MODEL, ModelConfig(max_tokens=32), runner, r, consumer="w1",
                     worker=WorkerConfig(block_ms=50, claim_idle_ms=CLAIM_IDLE_MS,
                                         shutdown_grace_s=HOUR))  # fmt: skip
    job = Producer(client=r).submit(MODEL, "the dog", priority=0)
    step = BatchLoopStep(SimpleNamespace())
    step.loops = [loop]
    step.threads = [threading.Thread(target=loop.run, daemon=True)]
    step.threads[0].start()
    try:
        assert runner.running.wait(HANG_GUARD_S)
        # When Celery terminates it (a cold shutdown)
        step.terminate(SimpleNamespace())
        # Then its loop ended without the step, the request unanswered and handed back
        assert not step.threads[0].is_alive()
        assert loop.wait_stopped(0)
        assert r.get(KEYS.result(job.id)) is None
        (pending,) = r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 10)
        assert pending["time_since_delivered"] >= CLAIM_IDLE_MS
    finally:
        runner.go.set()
