"""The generating scheduler planning ahead (``worker/gen_scheduler.py``), by its calls:
a step withdrawn before it ran (to be planned again) leaves no trace, its admissions
wait again (a resumed one with its state) and the policy's credit is given back; a
request failed while its runner may still run it (abandoned) is stopped once."""

from __future__ import annotations

from dataclasses import replace

from batchfleet.batching.gen_types import GenPolicy
from batchfleet.batching.generation import GenerationPolicy
from batchfleet.batching.types import Waiting
from batchfleet.schemas.messages import Request
from batchfleet.worker.answers import Held
from batchfleet.worker.gen_scheduler import GenScheduler
from batchfleet.worker.runner import (
    LOST,
    Failed,
    Final,
    Partial,
    Preempted,
    Prepared,
    Progress,
    StepEvent,
    StepReport,
)
from batchfleet.worker.streams import Entry


def held(key: str, lane: int, arrived: float, prompt: int = 8, new: int = 10) -> Held:
    prep = Prepared(None, rows=1, tokens=prompt, prompts=(prompt,), max_new_tokens=new)
    req = Request(id=key, model="m", inputs=["x"], max_new_tokens=new)
    return Held(Entry(lane, key, {}), req, "msgpack", prep, Waiting(key, lane, arrived, prompt),
                arrived)  # fmt: skip


def scheduler() -> GenScheduler:
    policy = GenPolicy(kv_cache_tokens=4096, page_size=16, step_tokens=256, max_running=8,
                       lanes=3, max_starvation_ms=1000.0)  # fmt: skip
    return GenScheduler(GenerationPolicy(policy), ahead=True)


def report(
    *events: StepEvent, progress: dict[str, Progress] | None = None, abandoned: tuple[str, ...] = ()
) -> StepReport:
    return StepReport(events=list(events), progress=progress or {}, abandoned=abandoned)


def test_a_withdrawn_step_gives_back_its_admissions_and_credit() -> None:
    s = scheduler()
    s.admit(held("run", 1, 0.0))
    first = s.decide(10.0).step
    assert first is not None and [h.waiting.key for h in first.held] == ["run"]
    # while it runs, lower lanes wait long past their bound (promoted: credit is spent)
    for k in range(3):
        s.admit(held(f"low{k}", 2, 0.5 + k))
    s.admit(held("mid", 1, 9.0))
    before = s.policy.credit()
    queued = s.decide(10.0).step
    assert queued is not None and s.queued == queued.step_id
    planned = [h.waiting.key for h in queued.held]
    spent = s.policy.credit()
    assert planned and spent != before
    s.withdraw(queued.step_id)
    assert s.queued is None and s.policy.credit() == before
    assert set(s.held) == {"low0", "low1", "low2", "mid"} and set(s.running) == {"run"}
    again = s.decide(10.0).step  # the same view plans the same step, at the same cost
    assert again is not None and [h.waiting.key for h in again.held] == planned
    assert s.policy.credit() == spent


def test_a_withdrawn_resumption_waits_again_as_preempted() -> None:
    s = scheduler()
    s.admit(held("a", 2, 0.0))
    s.admit(held("b", 1, 0.0))
    first = s.decide(1.0).step
    assert first is not None
    s.decide(1.0)  # the next one queued behind it
    s.running["a"].seq = 3  # deltas the loop counted
    s.finished(first.step_id, report(Partial("a", {}), Preempted("a", (9,), 9)), 1.0, 1.01)
    resume = s._resume["a"]
    assert s.held["a"] and resume.seq == 4  # the step's delta too (the device numbered it 4)
    running = s.inflight[0]
    queued = s.decide(1.02).step  # resumes "a"
    assert queued is not None and [h.waiting.key for h in queued.held] == ["a"]
    assert "a" not in s._resume
    s.withdraw(queued.step_id)
    assert s._resume["a"] == resume and "a" in s.held and "a" not in s.running
    again = s.decide(1.02).step
    assert again is not None and [h.waiting.key for h in again.held] == ["a"]
    assert s.running["a"].seq == 4 and s.running["a"].preempted == resume.preempted
    # once the step resuming it ran, it is never parked back by a withdrawal
    s.finished(running.step_id, report(progress={"b": Progress((9,), (0,), 8)}), 1.02, 1.03)
    s.finished(again.step_id, report(Final("b", [{}]),
                                     progress={"a": Progress((10,), (0,), 8)}), 1.03, 1.04)  # fmt: skip
    assert s.running["a"].resumed is None


def test_the_state_after_a_step_tells_what_the_steps_in_flight_admit() -> None:
    # Given a step running "run", one queued behind it admitting "next", and, once the
    # first ended, one more queued admitting "later" (two rows)
    from batchfleet.worker.generating import Generating
    from batchfleet.worker.inbox import StepDone

    s = scheduler()
    s.admit(held("run", 1, 0.0))
    first = s.decide(1.0).step
    s.admit(held("next", 1, 0.5))
    assert first is not None and s.decide(1.0).step is not None
    s.finished(first.step_id, report(progress={"run": Progress((9,), (0,), 9)}), 1.0, 1.01)
    pair = held("later", 1, 0.9)
    s.admit(replace(pair, prepared=replace(pair.prepared, rows=2, prompts=(8, 8))))
    third = s.decide(1.01).step
    assert third is not None and [h.waiting.key for h in third.held] == ["later"]
    assert len(s.inflight) == 2

    # When the loop states the model after the first step
    gen = Generating("m", None, s, None, None, None, lambda: 1.01)  # type: ignore[arg-type]
    state = gen._state(StepDone(first.step_id, report(), 1.0, 1.01), ())

    # Then all four sequences are admitted, three of them by the steps in flight (vLLM's
    # scheduler has those waiting until a step runs them)
    assert (state.running, state.admitting) == (4, 3)


def _abandoning(s: GenScheduler, *, cancel: bool = False) -> str:
    """``a`` and ``b`` admitted, the step after queued (``a`` cancelled first: it carries
    that stop); the first step's hand-off failed ``a``, abandoned. The queued step's id."""
    s.admit(held("a", 1, 0.0))
    s.admit(held("b", 1, 0.0))
    first = s.decide(1.0).step
    assert first is not None
    if cancel:
        assert s.stop("a", "cancelled") is None
    queued = s.decide(1.0).step
    assert queued is not None and queued.stop == ((("a", "cancelled"),) if cancel else ())
    failed = report(Partial("a", {}), Failed("a", "finishing the step failed"),
                    progress={"b": Progress((9,), (0,), 9)}, abandoned=("a",))  # fmt: skip
    s.finished(first.step_id, failed, 1.0, 1.01)
    assert set(s.running) == {"b"}
    return queued.step_id


def test_an_abandoned_request_is_stopped_with_the_next_step_even_one_planned_again() -> None:
    s = scheduler()
    _abandoning(s)
    planned = s.decide(1.02).step  # queued behind the one that runs
    assert planned is not None and planned.stop == (("a", LOST),)
    s.withdraw(planned.step_id)  # (an arrival or a cancel: planned again)
    again = s.decide(1.02).step
    assert again is not None and again.stop == (("a", LOST),)
    assert "a" not in s.running and "a" not in s.held  # answered: failed


def test_an_abandoned_request_its_runner_ends_meanwhile_is_not_stopped_again() -> None:
    # Given the queued step stopping ``a`` (a client cancelled it) when it is abandoned
    s = scheduler()
    queued = _abandoning(s, cancel=True)
    behind = s.decide(1.02).step  # planned while that stop is in flight: not stopped again
    assert behind is not None and behind.stop == ()
    # When that step's runner ends it (with the cancel)
    s.finished(queued, report(Final("a", [{}]), progress={"b": Progress((10,), (0,), 8)}),
               1.02, 1.03)  # fmt: skip
    # Then no later step stops it
    s.finished(behind.step_id, report(progress={"b": Progress((11,), (0,), 7)}), 1.03, 1.04)
    later = s.decide(1.04).step
    assert later is not None and later.stop == ()


def test_the_stops_of_a_step_whose_runner_raised_are_passed_on_again_once() -> None:
    # Given two running requests, "a" cancelled and "b" lost to another worker: the stops
    # go with the next step
    s = scheduler()
    s.admit(held("a", 0, 0.0))
    s.admit(held("b", 0, 0.0))
    first = s.decide(1.0).step
    assert first is not None
    s.finished(first.step_id, report(), 1.0, 1.01)
    s.stop("a", "cancelled")
    s.lose("b")
    stopping = s.decide(2.0).step
    assert stopping is not None and sorted(stopping.stop) == [("a", "cancelled"), ("b", LOST)]
    # When its runner raises (maybe before it applied them), then again in the next step
    # (which the executor takes for a broken runner, emptied: none are needed)
    s.finished(stopping.step_id, replace(report(), crashed=1), 2.0, 2.01)
    again = s.decide(3.0).step
    assert again is not None and sorted(again.stop) == sorted(stopping.stop)
    s.finished(again.step_id, replace(report(), crashed=2), 3.0, 3.01)
    # Then the first crash passed them on again with the next step, the second did not
    last = s.decide(4.0).step
    assert last is not None and last.stop == ()


def test_a_request_parked_and_ended_in_one_step_ends_counted_and_waits_no_more() -> None:
    # Given "a" running with 3 deltas sent, and a step whose events park it (a crashed
    # step's preemption, carried over) and then end it (stopped: its last delta, its result)
    s = scheduler()
    s.admit(held("a", 1, 0.0))
    first = s.decide(1.0).step
    assert first is not None
    s.running["a"].seq = 3
    events = (Partial("a", {}), Preempted("a", (9,), 9), Partial("a", {}), Final("a", [{}]))
    # When the loop takes the step in
    _, named = s.finished(first.step_id, report(*events), 1.0, 1.01)
    # Then it ended, its two deltas counted (its stream ends at 6), and it waits no more
    assert named["a"].seq == 5
    assert "a" not in s.running and "a" not in s.held and "a" not in s._resume
    assert s.decide(1.02).step is None
