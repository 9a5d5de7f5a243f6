"""A device thread outlives whatever a step does: a runner raising anything (a
``GeneratorExit`` too) fails the step's requests, a report whose deferred ``settle()``
raises fails those it left unfinished (so does a hand-off to the loop that raises, tried
again), and a ``SystemExit``/``KeyboardInterrupt`` stops
the loop, its requests handed back to the fleet. Each way, the loop hears of the step,
so it never waits for one that will not come. Threads are joined with a generous guard:
a loop that missed a step would hang the test, not pass late."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import decode_result
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.worker.deltas import DeltaWriter, StreamTo
from batchfleet.worker.executor import HANDOFF_TRIES, Executor
from batchfleet.worker.inbox import DeviceStopped, Event, StepDone, ThreadInbox
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runner import (
    Failed,
    Final,
    Partial,
    Prepared,
    StepEvent,
    StepReport,
    Work,
)
from batchfleet.worker.runners.embedding import EmbeddingRunner
from batchfleet.worker.streamed import Streamed
from devices import DEVICE

from batchfleet.config import ModelConfig, WorkerConfig

MODEL = "tiny"
KEYS = ModelKeys(MODEL)
HANG_GUARD_S = 60.0
CLAIM_IDLE_MS = 600_000
"""Long: a request handed back is marked idle this long; one merely left pending is not."""


def _prepared() -> Prepared:
    return Prepared(None, rows=1, tokens=1)


class Scripted:
    """Stands in for a runner: each step does what the next of ``steps`` says."""

    name = "scripted"
    device = "cpu"

    def __init__(self, *steps: Callable[[Work], StepReport]) -> None:
        self.steps = list(steps)

    def step(self, work: Work) -> StepReport:
        return self.steps.pop(0)(work)


def _wait_all(inbox: ThreadInbox, n: int) -> list[Event]:
    events: list[Event] = []
    while len(events) < n:
        event = inbox.get(HANG_GUARD_S)
        assert event is not None, f"the device posted {events}, then nothing"
        events.append(event)
    return events


def _finals(work: Work) -> StepReport:
    return StepReport([Final(key, ["ok"]) for key, _ in work.admit])


def test_a_report_whose_settle_raises_fails_what_it_left_unfinished_and_the_thread_goes_on() -> (
    None
):
    # Given a generating model's device thread (posting through its DeltaWriter), whose first
    # step streams "a" (running already), ends "b", admits "c", and leaves a deferred fill
    # that raises
    def unsettled(work: Work) -> StepReport:
        def fill() -> None:
            raise RuntimeError("progress lost")

        events: list[StepEvent] = [Partial("a", {"text": "x"}), Final("b", ["done"])]
        return StepReport(events, deferred=fill)

    streamed: list[Streamed] = []
    inbox = ThreadInbox()
    deltas = DeltaWriter(streamed.extend, inbox.put)
    device = Executor(Scripted(unsettled, _finals), lambda: 0.0, deltas.post)  # type: ignore[arg-type]
    deltas.expect([StreamTo("a", "id-a", MODEL, 60, None, "msgpack", seq=4)])
    device.start()
    # When it runs that step and another
    device.submit(Work("s1", (("b", _prepared()), ("c", _prepared()))))
    device.submit(Work("s2", (("d", _prepared()),)))
    first, second = _wait_all(inbox, 2)
    device.close(HANG_GUARD_S)
    # Then the loop heard of both: the first with its events, and every request it did
    # not end failed after them, with a clear message; the second ran as usual
    assert isinstance(first, StepDone) and first.step_id == "s1"
    events = first.report.events
    assert events[:2] == [Partial("a", {"text": "x"}), Final("b", ["done"])]
    assert [(e.key, e.code) for e in events[2:] if isinstance(e, Failed)] == [
        ("c", ErrorCode.INFERENCE_FAILED),
        ("a", ErrorCode.INFERENCE_FAILED),
    ]
    assert all("progress lost" in e.message for e in events[2:] if isinstance(e, Failed))
    assert isinstance(second, StepDone) and second.report.events == [Final("d", ["ok"])]
    assert not device.alive
    # ...and the first's delta was streamed once (it was handed over twice: the loop
    # counts it once, and numbers the stream's end after it)
    assert [(it.request_id, it.seq, it.text) for it in streamed] == [("id-a", 5, "x")]
    assert first.report.abandoned == ("c", "a")  # (the loop stops them in the runner)


class Refusing:
    """Hands steps to the loop (``inbox``), but its first ``refuse`` calls raise."""

    def __init__(self, inbox: ThreadInbox, refuse: int) -> None:
        self.inbox = inbox
        self.refuse = refuse
        self.calls = 0

    def __call__(self, done: StepDone | DeviceStopped) -> None:
        self.calls += 1
        if self.calls <= self.refuse:
            raise RuntimeError(f"hand-off {self.calls} refused")
        self.inbox.put(done)


@pytest.mark.parametrize("refuse", [2, HANDOFF_TRIES], ids=["repost-fails", "all-fail"])
def test_a_repost_that_raises_fails_the_step_once_and_the_thread_goes_on(refuse: int) -> None:
    # Given a device thread whose step ends "a" and streams "b", admitting both, and whose
    # hand-off to the loop raises ``refuse`` times: the step, then its repost (then all)
    inbox = ThreadInbox()
    post = Refusing(inbox, refuse)

    def first(work: Work) -> StepReport:
        return StepReport([Final("a", ["done"]), Partial("b", {"text": "x"})])

    device = Executor(Scripted(first, _finals), lambda: 0.0, post)  # type: ignore[arg-type]
    device.start()
    # When it runs that step and another
    device.submit(Work("s1", (("a", _prepared()), ("b", _prepared()))))
    device.submit(Work("s2", (("c", _prepared()),)))
    events = _wait_all(inbox, 1 if refuse == HANDOFF_TRIES else 2)
    device.close(HANG_GUARD_S)
    # Then the thread lived on to run the second step and end; the first, handed over at
    # its third try, ends "a" and fails "b" once, abandoned (given up: never handed over)
    assert not device.alive and post.calls == HANDOFF_TRIES + 1
    *handed, second = events
    assert isinstance(second, StepDone) and second.report.events == [Final("c", ["ok"])]
    if handed:
        (done,) = handed
        assert isinstance(done, StepDone) and done.step_id == "s1"
        assert [(type(e).__name__, e.key) for e in done.report.events] == [
            ("Final", "a"), ("Partial", "b"), ("Failed", "b")
        ]  # fmt: skip
        assert "hand-off 1 refused" in cast(Failed, done.report.events[2]).message
        assert done.report.abandoned == ("b",)


@pytest.mark.parametrize("stop", [SystemExit(3), KeyboardInterrupt()], ids=type)
def test_a_stop_raised_in_a_step_ends_the_device_thread_after_telling_the_loop(
    stop: BaseException,
) -> None:
    def stopping(work: Work) -> StepReport:
        raise stop

    inbox = ThreadInbox()
    device = Executor(Scripted(stopping, _finals), lambda: 0.0, inbox.put)  # type: ignore[arg-type]
    device.start()
    device.submit(Work("s1", (("a", _prepared()),)))
    (event,) = _wait_all(inbox, 1)
    assert isinstance(event, DeviceStopped) and event.step_id == "s1"
    assert type(stop).__name__ in event.reason
    assert device.wait(HANG_GUARD_S)  # ended, without a close


class Raising(EmbeddingRunner):
    """Its first ``len(raises)`` steps raise those (then it computes as usual)."""

    raises: list[BaseException]

    def step(self, work: Work) -> StepReport:
        if self.raises:
            raise self.raises.pop(0)
        return super().step(work)


def _raising(tiny_embedder: Path, *raises: BaseException) -> Raising:
    runner = Raising(tiny_embedder, device=DEVICE, max_tokens=32)
    runner.raises = list(raises)
    return runner


def _loop(r: redis.Redis, runner: Any, consumer: str, *, burst: bool) -> BatchLoop:
    return BatchLoop(MODEL, ModelConfig(path="/unused", max_tokens=32), runner, r,
                     consumer=consumer, burst=burst,
                     worker=WorkerConfig(block_ms=50, claim_idle_ms=CLAIM_IDLE_MS,
                                         shutdown_grace_s=3600))  # fmt: skip


def _run(loop: BatchLoop) -> None:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the loop hung"
    assert loop.wait_stopped(0)


def test_a_step_raising_a_base_exception_fails_its_requests_and_the_loop_goes_on(
    r: redis.Redis, tiny_embedder: Path
) -> None:
    # Given an encoder whose first step raises GeneratorExit (no Exception)
    runner = _raising(tiny_embedder, GeneratorExit("misused"))
    producer = Producer(client=r)
    first = producer.submit(MODEL, "the dog", priority=0)
    # When a burst loop serves it, and a request sent after it
    loop = _loop(r, runner, "w1", burst=True)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    failed = first.result(timeout=HANG_GUARD_S)
    later = producer.submit(MODEL, "the fox", priority=0)
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the loop hung"
    # Then the first failed with the runner's error, the next was computed, nothing pending
    assert failed.status == "error" and failed.error is not None
    assert failed.error.code is ErrorCode.INFERENCE_FAILED
    assert "GeneratorExit: misused" in failed.error.message
    assert later.result(timeout=1).ok
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


@pytest.mark.parametrize("stop", [SystemExit(1), KeyboardInterrupt()], ids=type)
def test_a_stop_raised_in_a_step_stops_the_loop_and_hands_its_requests_back(
    r: redis.Redis, tiny_embedder: Path, stop: BaseException
) -> None:
    # Given a request, and a (non-burst) loop whose device step raises a stop
    job = Producer(client=r).submit(MODEL, "the dog", priority=0)
    # When it runs
    _run(_loop(r, _raising(tiny_embedder, stop), "w1", burst=False))
    # Then it stopped by itself, unanswered, the request handed back (marked idle for the
    # next reclaim)...
    assert r.get(KEYS.result(job.id)) is None
    (pending,) = r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 10)
    assert pending["time_since_delivered"] >= CLAIM_IDLE_MS
    # ...so the next worker computes it (once the first's reclaim lock, 2 s, is gone)
    r.delete(KEYS.reclaim_lock)
    _run(_loop(r, _raising(tiny_embedder), "w2", burst=True))
    raw = r.get(KEYS.result(job.id))
    assert raw is not None and decode_result(raw).ok
