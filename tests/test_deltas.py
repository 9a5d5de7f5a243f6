"""A generating model's deltas leave from the device thread (``worker/deltas.py``): each
request numbered on from where it was, before the step reaches the loop, and only for
the requests the loop said stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import pytest
from batchfleet.worker.deltas import DeltaWriter, StreamTo
from batchfleet.worker.inbox import StepDone
from batchfleet.worker.runner import Failed, Final, Partial, Preempted, StepEvent, StepReport
from batchfleet.worker.streamed import Streamed, plain_delta


def chunk(text: str) -> dict[str, Any]:
    return {"input": 0, "text": text, "tokens": 1}


def to(key: str, seq: int = 0) -> StreamTo:
    return StreamTo(key, f"id-{key}", "m", 60, "chan", "msgpack", seq)


class Recorded:
    def __init__(self, failing: tuple[int, ...] = ()) -> None:
        self.log: list[tuple[str, Any]] = []
        self.failing = failing
        """The calls to :meth:`stream` that raise (1: the first), writing nothing."""
        self.calls = 0

    def stream(self, items: Sequence[Streamed]) -> None:
        self.calls += 1
        if self.calls in self.failing:
            raise RuntimeError("sink down")
        self.log += [("delta", (it.request_id, it.seq, it.delta and it.delta.text)) for it in items]

    def then(self, done: StepDone) -> None:
        self.log.append(("step", done.step_id))


def step(step_id: str, *events: StepEvent) -> StepDone:
    return StepDone(step_id, StepReport(events=list(events)), 0.0, 1.0)


def test_deltas_are_numbered_per_request_and_leave_before_the_step() -> None:
    rec = Recorded()
    w = DeltaWriter(rec.stream, rec.then)
    w.expect([to("a"), to("b")])
    w.post(step("s1", Partial("a", chunk("x")), Partial("b", chunk("y")), Partial("a", chunk("z"))))
    w.post(step("s2", Partial("b", chunk("w")), Final("b", [])))
    assert rec.log == [
        ("delta", ("id-a", 1, "x")), ("delta", ("id-b", 1, "y")), ("delta", ("id-a", 2, "z")),
        ("step", "s1"),
        ("delta", ("id-b", 2, "w")),
        ("step", "s2"),
    ]  # fmt: skip


def test_a_request_not_expected_or_ended_streams_nothing_and_a_resumed_one_numbers_on() -> None:
    rec = Recorded()
    w = DeltaWriter(rec.stream, rec.then)
    w.expect([to("a"), to("b")])
    w.post(step("s1", Partial("a", chunk("x")), Partial("quiet", chunk("q"))))
    w.post(step("s2", Preempted("a", (5,), 3), Partial("b", chunk("u")), Final("b", [])))
    w.post(step("s3", Partial("b", chunk("late"))))  # ended: not streamed
    w.expect([to("a", seq=1)])  # resumed, the loop's count with it
    w.post(step("s4", Partial("a", chunk("y"))))
    deltas = [x for kind, x in rec.log if kind == "delta"]
    assert deltas == [("id-a", 1, "x"), ("id-b", 1, "u"), ("id-a", 2, "y")]
    assert [x for kind, x in rec.log if kind == "step"] == ["s1", "s2", "s3", "s4"]


def test_a_parked_request_stopped_streams_the_delta_it_ends_with_numbered_on() -> None:
    # Given a streaming request parked whole (preempted) after two deltas
    rec = Recorded()
    w = DeltaWriter(rec.stream, rec.then)
    w.expect([to("a")])
    w.post(step("s1", Partial("a", chunk("x")), Partial("a", chunk("y"))))
    w.post(step("s2", Preempted("a", (5,), 3)))
    # When it is stopped while parked (a deadline, a cancel): a step that admits nothing
    # (nothing expected) carries its last delta and its result
    w.post(step("s3", Partial("a", chunk("z")), Final("a", [])))
    w.post(step("s4", Partial("a", chunk("late"))))
    # Then that delta is streamed, right after the last one (the loop's end follows it)
    deltas = [x for kind, x in rec.log if kind == "delta"]
    assert deltas == [("id-a", 1, "x"), ("id-a", 2, "y"), ("id-a", 3, "z")]


def test_a_sequence_preempted_alone_leaves_its_request_streaming_and_numbering_on() -> None:
    # (its siblings run on; when it resumes its deltas follow its last one, nothing resent)
    rec = Recorded()
    w = DeltaWriter(rec.stream, rec.then)
    w.expect([to("a")])
    w.post(step("s1", Partial("a", chunk("x")), Preempted("a", (5,), 3, (1,), alone=True)))
    w.post(step("s2", Partial("a", chunk("y"))))
    assert [x for kind, x in rec.log if kind == "delta"] == [("id-a", 1, "x"), ("id-a", 2, "y")]


def test_the_runner_finishes_its_report_after_the_deltas_and_before_the_loop_has_it() -> None:
    rec = Recorded()
    w = DeltaWriter(rec.stream, rec.then)
    w.expect([to("a")])
    done = step("s1", Partial("a", chunk("x")))
    done.report.deferred = lambda: rec.log.append(("settled", "s1"))
    w.post(done)
    assert rec.log == [
        ("delta", ("id-a", 1, "x")), ("settled", "s1"), ("step", "s1")
    ]  # fmt: skip
    done.report.settle()  # once only
    assert rec.log.count(("settled", "s1")) == 1


def test_deltas_are_written_checked_while_the_worker_may_have_been_taken_for_dead() -> None:
    # (tokens.lua checks a negative life against the stream's last entry: only then)
    lives: list[int] = []
    suspect = [False]
    w = DeltaWriter(lambda items: lives.extend(it.life for it in items), lambda done: None,
                    suspect=lambda: suspect[0])  # fmt: skip
    w.expect([StreamTo("a", "id-a", "m", 60, None, "msgpack", 0, life=2)])
    w.post(step("s1", Partial("a", chunk("x"))))
    suspect[0] = True
    w.post(step("s2", Partial("a", chunk("y"))))
    suspect[0] = False
    w.post(step("s3", Partial("a", chunk("z"))))
    assert lives == [2, -2, 2]
    assert StreamTo("a", "id-a", "m", 60, None, "msgpack", 3, life=2).delta(4, None).life == -2


def test_deltas_whose_write_failed_are_written_with_the_step_posted_again() -> None:
    # Given a write that fails once, in a step that ends one of two streaming requests
    rec = Recorded(failing=(2,))
    w = DeltaWriter(rec.stream, rec.then)
    w.expect([to("a"), to("b")])
    w.post(step("s1", Partial("a", chunk("x"))))
    events: list[StepEvent] = [Partial("a", chunk("y")), Partial("b", chunk("z")), Final("b", [])]
    with pytest.raises(RuntimeError):
        w.post(step("s2", *events))
    # When the executor posts the step again, its unfinished request failed
    w.post(step("s2", *events, Failed("a", "finishing the step failed")))
    w.post(step("s3", Partial("a", chunk("late"))))  # (a failed request streams no more)
    # Then its deltas are written first, numbered as the first time, before the step
    assert rec.log == [
        ("delta", ("id-a", 1, "x")), ("step", "s1"),
        ("delta", ("id-a", 2, "y")), ("delta", ("id-b", 1, "z")), ("step", "s2"),
        ("step", "s3"),
    ]  # fmt: skip


def test_deltas_that_fail_again_are_left_out_and_the_requests_they_end_fail() -> None:
    # Given a step whose deltas fail to be written twice: the first time, and posted again
    rec = Recorded(failing=(2, 3))
    loop: list[StepDone] = []
    w = DeltaWriter(rec.stream, loop.append)
    w.expect([to("a"), to("b"), to("c")])
    w.post(step("s1", Partial("a", chunk("x")), Partial("c", chunk("v"))))
    events: list[StepEvent] = [Partial("c", chunk("w")), Preempted("c", (5,), 3),
                               Partial("a", chunk("y")), Partial("b", chunk("z")), Final("b", [])]  # fmt: skip
    with pytest.raises(RuntimeError):
        w.post(step("s2", *events))
    # When the executor posts it again (its unfinished request failed)
    w.post(step("s2", *events, Failed("a", "finishing the step failed")))
    # Then the loop gets it without the deltas, so it numbers each stream's end after the
    # last delta written; the requests it ended or parked fail (their deltas fall short of
    # their text), a parked one abandoned (the runner holds it)
    assert [d.step_id for d in loop] == ["s1", "s2"]
    report = loop[1].report
    assert report.events == [
        Failed("c", "writing its deltas failed: RuntimeError('sink down')"),
        Failed("b", "writing its deltas failed: RuntimeError('sink down')"),
        Failed("a", "finishing the step failed"),
    ]
    assert report.abandoned == ("c",)
    assert [x for kind, x in rec.log if kind == "delta"] == [("id-a", 1, "x"), ("id-c", 1, "v")]
    # ...and they stream no more (a resumed one is expected again, numbered on)
    w.expect([to("c", seq=1)])
    w.post(step("s3", Partial("a", chunk("late")), Partial("c", chunk("again"))))
    assert rec.log[2:] == [("delta", ("id-c", 2, "again"))]


def test_a_plain_delta_equals_the_streamed_its_keywords_build() -> None:
    # plain_delta passes every field by position (the device thread's per-row path)
    made = plain_delta("id-a", 3, "tok", 60, "chan", "json", 1, 2, "m", 4)
    want = Streamed("id-a", 3, "tok", 60, "chan", "json", 1, 2, "m", life=4, plain=True)
    assert made == want  # ...and field by field: ``plain`` is left out of ``==``
    assert [getattr(made, f.name) for f in fields(Streamed)] == [
        getattr(want, f.name) for f in fields(Streamed)
    ]
    assert made.item() == want.item() == want.write().item()
