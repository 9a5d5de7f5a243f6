"""What a generating runner's step that raised part-way through one request's change
leaves (the runner stepped directly, the tiny Llama, both engines;
``worker/runners/gen_step.py``): a start whose sequences were added in part (its
constraint compiled) is rolled back and starts whole with the next step; a beam search's
best beams taken in part are taken again whole, not twice; a constraint that failed to
compile in a step that raised is answered once, with the next step; a LoRA adapter's
unloading that fails a request a step that raised admitted is not handed over (the
executor answered it); a resume of sequences preempted alone, cut after some were added,
is rolled back (none left parked) and starts whole after the next step; a beam round
added in part is taken back (engine and sampler) and added whole, under new names."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from batchfleet.schemas.errors import ErrorCode
from batchfleet.worker.generation.detok import Decode
from batchfleet.worker.generation.grammar import GrammarError
from batchfleet.worker.runner import Failed, Final, Preempted, StepReport, Work
from batchfleet.worker.runners.gen_state import GenReq, GenSeq
from conftest import TINY_LM_OPTIONS
from devices import DEVICE
from gen_faults import ENGINES, Breaking, compiling, ends, make_runner, prepared
from test_gen_step_crash_ends import EndCrash

pytestmark = pytest.mark.timeout(180)
NEW = 4
"""Tokens each sequence generates (``ignore_eos``)."""


def _steps(runner: Breaking, first: int, count: int, crash: str = "") -> list[StepReport]:
    """``count`` empty steps from step ``first``; one raising ``crash`` is let through."""
    reports = []
    for k in range(first, first + count):
        try:
            reports.append(runner.step(Work(f"s{k}", ())))
        except RuntimeError as exc:
            if not crash or crash not in str(exc):
                raise
    return reports


class StartCrash(Breaking):
    """The tiny Llama whose engine, adding the sequence ``victim``, adds it and raises, once
    (a start left part-done: the request's sequences before it added, that one half)."""

    victim = ""

    def _start_seq(self, r: GenReq, seq: GenSeq, lane: int) -> None:
        if seq.name != self.victim:
            return super()._start_seq(r, seq, lane)
        self.victim = ""
        add = self.engine.add

        def add_then_raise(*args: Any, **kwargs: Any) -> None:
            add(*args, **kwargs)
            raise RuntimeError("runner bug adding a sequence")

        with mock.patch.object(self.engine, "add", add_then_raise):
            super()._start_seq(r, seq, lane)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("victim", ["c#0", "c#1"], ids=["first", "second"])
def test_a_start_a_crashed_step_left_part_done_is_rolled_back_and_starts_whole(
    tiny_lm: Path, engine: str, victim: str
) -> None:
    # Given a runner stepped directly, a request of two completions admitted while its
    # constraint compiles, and an engine that raises once as it adds one of its sequences
    # (after adding it): the first (none of them started), or the second (the first
    # started)
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=StartCrash)
    runner.victim = victim
    prep, constraint = compiling(prepared(runner, "c", max_new_tokens=NEW, n=2, ignore_eos=True))
    reports = [runner.step(Work("s1", (("c", prep),)))]
    # When its constraint is compiled (none), and the step that starts it raises
    constraint.set_result(None)
    with pytest.raises(RuntimeError, match="adding a sequence"):
        runner.step(Work("s2", ()))
    reports += _steps(runner, 3, 3 * NEW)
    # Then the next step started it whole: it ended once, each completion with all its
    # tokens, and the engine holds none of its sequences
    got = ends(reports)
    assert [type(ev) for ev in got["c"]] == [Final]
    final = got["c"][0]
    assert isinstance(final, Final)
    assert [o["completion_tokens"] for o in final.outputs] == [NEW, NEW]
    assert not runner._reqs and not runner._by_seq
    assert runner.engine.state("c#0") is None and runner.engine.state("c#1") is None


class BeamTextCrash(Breaking):
    """The tiny Llama whose beam request ``victim`` raises once as its second output takes
    its beam's text (the first output took its own already)."""

    victim = "crashy"
    raised = 0

    def _beam_results(self, r: GenReq) -> None:
        if r.key == self.victim and not self.raised:
            text = r.seqs[1].text
            text.decode = self._raising_once(text.decode)
        super()._beam_results(r)

    def _raising_once(self, decode: Decode) -> Decode:
        def once(ids: Any) -> str:
            if not self.raised:
                self.raised += 1
                raise RuntimeError("runner bug decoding a beam")
            return decode(ids)

        return once


@pytest.mark.parametrize("engine", ENGINES)
def test_a_beam_search_whose_results_a_crashed_step_took_in_part_takes_them_once(
    tiny_lm: Path, engine: str
) -> None:
    # Given a runner stepped directly that served a beam search of width 2 ("clean")
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=BeamTextCrash)
    beam = {"max_new_tokens": NEW, "n": 2, "use_beam_search": True, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    clean = prepared(runner, "clean", **beam)
    reports = [runner.step(Work("s1", (("clean", clean),))), *_steps(runner, 2, 2 * NEW)]
    # When the same search again ("crashy") raises as its second output takes its text
    crashy = prepared(runner, "crashy", **beam)
    reports += [runner.step(Work("t1", (("crashy", crashy),)))]
    reports += _steps(runner, 2, 2 * NEW, crash="decoding a beam")
    # Then it ended once, with the clean one's texts and tokens (none taken twice)
    got = ends(reports)
    assert runner.raised == 1
    want, final = got["clean"][0], got["crashy"]
    assert isinstance(want, Final) and [type(ev) for ev in final] == [Final]
    outputs = final[0].outputs  # type: ignore[union-attr]
    assert [o["text"] for o in outputs] == [o["text"] for o in want.outputs]
    assert [o["completion_tokens"] for o in outputs] == [NEW, NEW]
    assert not runner._reqs


@pytest.mark.parametrize("engine", ENGINES)
def test_a_constraint_failure_a_crashed_step_built_is_handed_over_once(
    tiny_lm: Path, engine: str
) -> None:
    # Given a runner stepped directly, running a request beside one admitted while its
    # constraint compiles, whose second step raises once all its events are built
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=EndCrash)
    runner.at_report = 2
    running = prepared(runner, "running", max_new_tokens=NEW, ignore_eos=True)
    bad, constraint = compiling(prepared(runner, "bad", max_new_tokens=NEW, ignore_eos=True))
    reports = [runner.step(Work("s1", (("running", running), ("bad", bad))))]
    # When its constraint fails to compile, in the step that raises
    constraint.set_exception(GrammarError("no such grammar"))
    with pytest.raises(RuntimeError, match="at a step's end"):
        runner.step(Work("s2", ()))
    reports += _steps(runner, 3, 2 * NEW)
    # Then the next step handed its failure over (the request's own fault), once, and the
    # running one ran to its end
    got = ends(reports)
    assert [type(ev) for ev in got["bad"]] == [Failed]
    failure = got["bad"][0]
    assert isinstance(failure, Failed) and failure.code == ErrorCode.INVALID_REQUEST
    assert "no such grammar" in failure.message
    assert got["bad"][0] in reports[1].events
    assert [type(ev) for ev in got["running"]] == [Final]
    assert not runner._reqs and not runner._compiling


@pytest.mark.parametrize("engine", ENGINES)
def test_a_lora_failure_of_a_request_a_crashed_step_admitted_is_not_handed_over(
    tiny_lm: Path, tmp_path: Path, engine: str
) -> None:
    # Given a runner stepped directly with an adapter, running a request, and one read
    # with that adapter, which an operator unloads before the step that admits it; that
    # step raises once all its events are built
    from test_generation_lora import make_adapter

    adapter = make_adapter(tmp_path / "sql", tiny_lm)
    options = {**TINY_LM_OPTIONS, "engine": engine, "lora_adapters": {"sql": str(adapter)}}
    runner = EndCrash(tiny_lm, device=DEVICE, dtype="float32", options=options)
    runner.break_at, runner.schedule_ahead, runner.at_report = 0, False, 2
    running = prepared(runner, "running", max_new_tokens=NEW, ignore_eos=True)
    adapted = prepared(runner, "adapted", max_new_tokens=NEW, ignore_eos=True, lora="sql")
    reports = [runner.step(Work("s1", (("running", running),)))]
    runner.unload_lora("sql")
    # When the step that admits it fails it (its adapter unloaded) and raises
    with pytest.raises(RuntimeError, match="at a step's end"):
        runner.step(Work("s2", (("adapted", adapted),)))
    reports += _steps(runner, 3, 2 * NEW)
    # Then its failure is not handed over (the executor fails what a step that raised
    # admitted: answered once), the running one ran to its end, and the runner holds none
    got = ends(reports)
    assert "adapted" not in {ev.key for report in reports for ev in report.events}
    assert [type(ev) for ev in got["running"]] == [Final]
    assert not runner._reqs


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("victim", ["c#1", "c#2"], ids=["first", "second"])
def test_a_resume_a_crashed_step_left_part_done_is_rolled_back_and_starts_whole(
    tiny_lm: Path, engine: str, victim: str
) -> None:
    # Given a runner stepped directly, serving a seeded sampled request of three
    # completions, two of them preempted alone in its third step
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=StartCrash)
    sampled = {"max_new_tokens": 2 * NEW, "n": 3, "temperature": 0.3, "seed": 7,
               "ignore_eos": True}  # fmt: skip
    clean = prepared(runner, "clean", **sampled)
    reports = [runner.step(Work("t1", (("clean", clean),))), *_steps(runner, 2, 3 * NEW)]
    prep = prepared(runner, "c", **sampled)
    reports += [runner.step(Work("s1", (("c", prep),))), runner.step(Work("s2", ()))]
    reports += [runner.step(Work("s3", (), preempt_seqs=(("c", (1, 2)),)))]
    # When the step that resumes both raises as the engine adds one of them (after adding
    # it): the first (none of them back in the engine), or the second (the first back)
    runner.victim = victim
    with pytest.raises(RuntimeError, match="adding a sequence"):
        runner.step(Work("s4", (), resume=(("c", (1, 2), 0),)))
    reports += _steps(runner, 5, 4 * NEW)
    # Then both were started whole after the next step: it ended once, each completion
    # with all its tokens and the text of the same request served without a preemption,
    # and the engine holds none of its sequences
    got = ends(reports)
    assert [type(ev) for ev in got["c"]] == [Preempted, Preempted, Final]
    want, final = got["clean"][0], got["c"][-1]
    assert isinstance(want, Final) and isinstance(final, Final)
    assert [o["completion_tokens"] for o in final.outputs] == [2 * NEW] * 3
    assert [o["text"] for o in final.outputs] == [o["text"] for o in want.outputs]
    assert not runner._reqs and not runner._by_seq
    assert all(runner.engine.state(f"c#{i}") is None for i in range(3))


class RoundCrash(Breaking):
    """The tiny Llama whose engine, adding its ``victim``-th beam round sequence (counted
    from 1 over the runner's life), adds it and raises, once."""

    victim = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.beam_adds: list[str] = []

    def _start_round(self, r: GenReq, lane: int) -> None:
        add = self.engine.add

        def counted(name: str, *args: Any, **kwargs: Any) -> None:
            add(name, *args, **kwargs)
            self.beam_adds.append(name)
            if len(self.beam_adds) == self.victim:
                raise RuntimeError("runner bug adding a beam")

        with mock.patch.object(self.engine, "add", counted):
            super()._start_round(r, lane)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("victim", [5, 6], ids=["first", "second"])
def test_a_beam_round_a_crashed_step_left_part_added_is_rolled_back_and_added_whole(
    tiny_lm: Path, engine: str, victim: int
) -> None:
    # Given a runner stepped directly that served a beam search of width 3 ("clean")
    runner = make_runner(tiny_lm, ahead=False, engine=engine, break_at=0, kind=RoundCrash)
    beam = {"max_new_tokens": NEW, "n": 3, "use_beam_search": True, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    clean = prepared(runner, "clean", **beam)
    reports = [runner.step(Work("s1", (("clean", clean),))), *_steps(runner, 2, 2 * NEW)]
    # When the same search again ("crashy") raises as the engine adds a sequence of its
    # third round (after adding it; rounds of 1, 3 and 3 beams: the 5th and 6th adds of
    # its own): the round's first (none of it added before), or its second (one added)
    runner.victim = len(runner.beam_adds) + victim
    crashy = prepared(runner, "crashy", **beam)
    reports += [runner.step(Work("t1", (("crashy", crashy),)))]
    reports += _steps(runner, 2, 3 * NEW, crash="adding a beam")
    # Then the round was taken back and added whole by the next step: it ended once with
    # the clean one's texts and tokens, and the engine holds (and its sampler keeps) none
    # of its round sequences, those taken back included
    got = ends(reports)
    assert runner.victim <= len(runner.beam_adds)
    want, final = got["clean"][0], got["crashy"]
    assert isinstance(want, Final) and [type(ev) for ev in final] == [Final]
    outputs = final[0].outputs  # type: ignore[union-attr]
    assert [o["text"] for o in outputs] == [o["text"] for o in want.outputs]
    assert [o["completion_tokens"] for o in outputs] == [NEW] * 3
    assert not runner._reqs and not runner._beam_seqs
    crashy_adds = [name for name in runner.beam_adds if name.startswith("crashy#")]
    assert all(runner.engine.state(name) is None for name in crashy_adds)
    tracked = runner.engine.sampler._tracks  # type: ignore[attr-defined]
    assert not [name for name in crashy_adds if name in tracked]
