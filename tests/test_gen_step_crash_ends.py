"""What a generating runner's step that raised leaves for the steps after it (real Redis,
the tiny Llama, both engines, both scheduling modes; ``worker/crashes.py``,
``worker/runners/gen_step.py``): a request it lost fails even where the hand-off of the
step after it raises, or where its deltas were carried over; a beam search it left mid-way (searches ended, results not built;
a round advanced, the next not started) ends with its beams or goes on. And, the runner
stepped directly (no loop), a request stopped while preempted or while its constraint
compiles whose end the step lost ends with the next one."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.client import Job
from batchfleet.schemas.keys import GROUP
from batchfleet.worker.runner import (
    Final,
    Partial,
    Preempted,
    StepEvent,
    StepReport,
    Work,
)
from batchfleet.worker.runners.gen_state import GenReq, GenSeq
from gen_checks import failed_with, stream_entries, whole
from gen_faults import (
    ENGINES,
    KEYS,
    MODEL,
    Breaking,
    ends,
    make_loop,
    make_runner,
    prepared,
    run_loop,
    submit,
)

pytestmark = pytest.mark.timeout(180)
BEAM_NEW = 5
"""Rounds a beam search runs (``ignore_eos``: each beam ends by length)."""


@pytest.fixture(params=[True, False], ids=["ahead", "in-turn"])
def ahead(request: pytest.FixtureRequest) -> bool:
    """The runners' ``schedule_ahead``: each test runs both ways."""
    return bool(request.param)


class SettleFailsAfterCrash(Breaking):
    """:class:`~gen_faults.Breaking` whose step ``break_at`` raises once it ran (``crash``),
    and whose next step's hand-off raises (its deferred progress fill)."""

    def step(self, work: Work) -> StepReport:
        report = super().step(work)
        if self.steps == self.break_at + 1:

            def deferred() -> None:
                raise RuntimeError("progress lost after a crash")

            report.deferred = deferred
        return report


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_lost_in_a_crash_fails_though_the_next_steps_settle_raises(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str
) -> None:
    # Given a short generation (it ends in the second step) beside a longer one, neither
    # streaming, and a runner whose second step raises once it ran (the short one's end
    # lost with it) and whose third step's hand-off raises, its progress part filled
    producer = Producer(client=r)
    short = submit(producer, "the fox", 2, stream=False)
    long = submit(producer, "the dog", 20, stream=False)
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=2,
                         crash=RuntimeError("runner bug"), kind=SettleFailsAfterCrash)  # fmt: skip
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True))
    # Then the short one, which the runner no longer held, failed with the first step
    # that settled, not left waiting for ever; the long one (the failed hand-off did not
    # name it) ran to its end
    assert len(runner.crashed) == 1
    failed_with(short, "generation lost: a step before this one crashed")
    whole(long, 20)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


class ResultCrash(Breaking):
    """The tiny Llama whose step raises once, while it builds the result of the request
    whose prompt holds ``victim`` (after it left the runner, before its result exists)."""

    victim = "fox"

    def _cancel(self, seqs: list[GenSeq]) -> None:
        ending = bool(seqs) and seqs[0].name.rsplit("#", 1)[0] not in self._reqs  # (_final)
        if ending and self.victim and self.victim in self.tokenizer.decode(seqs[0].prompt):
            self.victim = ""
            raise RuntimeError("runner bug building a result")
        super()._cancel(seqs)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_whose_result_a_crashed_step_could_not_build_fails_its_deltas_aside(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str
) -> None:
    # Given a short streaming generation (it ends in the second step) beside a longer one,
    # and a runner whose step raises while it builds the short one's result, once its
    # last delta was built (carried over with the next step)
    producer = Producer(client=r)
    short = submit(producer, "the fox", 2, stream=True)
    long = submit(producer, "the dog", 20, stream=True)
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=0, kind=ResultCrash)
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True))
    # Then the short one, which its runner no longer held, failed with the next step, its
    # token stream ended once; its deltas did not pass it for a request still running
    assert not runner.victim
    failed_with(short, "generation lost: a step before this one crashed")
    stream_entries(r, short)
    whole(long, 20, stream=True)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


class BeamCrash(Breaking):
    """The tiny Llama whose first beam search to reach ``where`` raises there, once:
    ``"results"``: its searches ended and its best beams became its outputs, before its
    result is built; ``"searches"``: its searches ended, before their best beams are
    taken; ``"round"``: its second round advanced it, before its third starts."""

    where = "results"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raised = 0

    def _raise(self) -> None:
        self.raised += 1
        raise RuntimeError(f"runner bug at a beam search's {self.where}")

    def _finish(self, r: GenReq, stream: bool = True) -> list[StepEvent]:
        if self.where == "results" and r.beams is not None and not self.raised:
            self._raise()
        return super()._finish(r, stream)

    def _beam_results(self, r: GenReq) -> None:
        if self.where == "searches" and not self.raised:
            self._raise()
        super()._beam_results(r)

    def _start(self, r: GenReq, lane: int) -> None:
        rounds = r.beams.searches[0].rounds if r.beams is not None else 0
        if self.where == "round" and rounds == 2 and not self.raised:
            self._raise()
        super()._start(r, lane)


def _beams(producer: Producer) -> Job:
    return producer.submit(MODEL, "the dog", max_new_tokens=BEAM_NEW, n=2, use_beam_search=True,
                           temperature=0.0, ignore_eos=True, priority=0)  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("where", ["results", "searches", "round"])
def test_a_beam_search_a_crashed_step_left_mid_way_ends_with_its_beams(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str, where: str
) -> None:
    # Given a beam search of width 2 beside a sampled generation, served once by a runner
    # that does not raise, and again by one whose step raises in the beam search (as
    # ``where`` says), once
    producer = Producer(client=r)
    clean = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=0)
    expected = _beams(producer)
    run_loop(make_loop(r, clean, "w0", burst=True))
    beams = _beams(producer)
    other = submit(producer, "the cat", 12, stream=True)
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=0, kind=BeamCrash)
    runner.where = where
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True))
    # Then the step raised once, and the beam search was answered with the beams of the
    # run that did not raise, not left waiting for ever; the other one ran to its end
    assert runner.raised == 1
    want, got = expected.result(timeout=1), beams.result(timeout=1)
    assert want.ok and got.ok and got.outputs is not None and want.outputs is not None
    assert [o["text"] for o in got.outputs] == [o["text"] for o in want.outputs]
    assert got.usage == want.usage
    whole(other, 12, stream=True)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


class EndCrash(Breaking):
    """The tiny Llama whose step raises once, when it ends the request ``victim``
    (before its events are built); and step ``at_report`` (0: none), once all its events
    are built."""

    victim = ""
    at_report = 0

    def _reported(self, report: StepReport, events: list[StepEvent], prefilled: int) -> StepReport:
        if self.steps == self.at_report:
            raise RuntimeError("runner bug at a step's end")
        return super()._reported(report, events, prefilled)

    def _finish(self, r: GenReq, stream: bool = True) -> list[StepEvent]:
        if r.key == self.victim:
            self.victim = ""
            raise RuntimeError("runner bug at a request's end")
        return super()._finish(r, stream)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("state", ["parked", "compiling"])
def test_a_request_stopped_aside_whose_end_a_crashed_step_lost_ends_with_the_next(
    tiny_lm: Path, engine: str, state: str
) -> None:
    # Given a runner stepped directly, running a streaming request and one that is
    # aside: preempted ("parked"), or admitted while its constraint compiles ("compiling")
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=EndCrash)
    runner.victim = "aside"
    aside = prepared(runner, "aside", max_new_tokens=16, stream=True, ignore_eos=True)
    running = prepared(runner, "running", max_new_tokens=4, stream=True, ignore_eos=True)
    pending: Future[Any] = Future()  # never compiled
    if state == "compiling":
        aside = replace(aside, payload=replace(aside.payload, compiling=pending))
    reports = [runner.step(Work("s1", (("aside", aside), ("running", running))))]
    reports.append(runner.step(Work("s2", (), preempt=("aside",) * (state == "parked"))))
    # When the step that cancels it raises as it ends it
    with pytest.raises(RuntimeError, match="at a request's end"):
        runner.step(Work("s3", (), stop=(("aside", "cancelled"),)))
    reports += [runner.step(Work(f"s{k}", ())) for k in range(4, 8)]
    # Then the next step ended it once, with what it generated (cancelled), and the
    # running one ended too, once
    got = ends(reports)
    parked = [Preempted] * (state == "parked")
    assert [type(ev) for ev in got["aside"]] == [*parked, Final]
    end = got["aside"][-1]
    assert isinstance(end, Final) and end.outputs[0]["finish_reason"] == "cancelled"
    assert [type(ev) for ev in got["running"]] == [Final]
    assert "aside" in {ev.key for ev in reports[2].events}
    assert not runner._reqs


@pytest.mark.parametrize("engine", ENGINES)
def test_the_events_of_requests_a_crashed_step_admitted_are_not_carried_over(
    tiny_lm: Path, engine: str
) -> None:
    # Given a runner stepped directly, running a streaming request, whose second step
    # admits another that ends in it (one token), and raises once all its events are built
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=EndCrash)
    runner.at_report = 2
    running = prepared(runner, "running", max_new_tokens=8, stream=True, ignore_eos=True)
    doomed = prepared(runner, "doomed", max_new_tokens=1, stream=True, ignore_eos=True)
    runner.step(Work("s1", (("running", running),)))
    # When that step raises (the executor fails what it admitted: "doomed")
    with pytest.raises(RuntimeError, match="at a step's end"):
        runner.step(Work("s2", (("doomed", doomed),)))
    after = runner.step(Work("s3", ()))
    # Then the next step hands over the running one's delta of the step that raised, and
    # nothing of the one it admitted (answered failed already)
    keys = [ev.key for ev in after.events]
    assert keys.count("running") == 2 and "doomed" not in keys
    assert "doomed" not in runner._reqs


@pytest.mark.parametrize("engine", ENGINES)
def test_a_preemption_a_crashed_step_made_is_handed_over_and_the_request_resumes(
    tiny_lm: Path, engine: str
) -> None:
    # Given a runner stepped directly, running a streaming request, whose second step
    # preempts it and raises once all its events are built
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=EndCrash)
    runner.at_report = 2
    prep = prepared(runner, "aside", max_new_tokens=8, stream=True, ignore_eos=True)
    reports = [runner.step(Work("s1", (("aside", prep),)))]
    with pytest.raises(RuntimeError, match="at a step's end"):
        runner.step(Work("s2", (), preempt=("aside",)))
    # When the next step runs, and the request is admitted again after it
    reports.append(runner.step(Work("s3", ())))
    reports += [runner.step(Work(f"s{k}", (("aside", prep),) * (k == 4))) for k in range(4, 14)]
    # Then that step handed the preemption over (the loop learns it is parked), and the
    # request resumed to its end, its deltas adding up to its result
    assert [type(ev) for ev in reports[1].events] == [Preempted]
    assert [type(ev) for ev in ends(reports)["aside"]] == [Preempted, Final]
    final = ends(reports)["aside"][-1]
    assert isinstance(final, Final) and final.outputs[0]["completion_tokens"] == 8
    deltas = [ev.chunk for rep in reports for ev in rep.events if isinstance(ev, Partial)]
    assert "".join(d["text"] for d in deltas) == final.outputs[0]["text"]
    assert sum(d["tokens"] for d in deltas) == 8
