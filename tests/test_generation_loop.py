"""The loop with a generating (continuous) runner, in virtual time: requests join and
leave between steps, deltas are numbered, deadlines expire or stop, clients cancel,
the admission policy preempts for lane 0, a failing step fails only what ran, and a
stop lets running generations end. A scripted runner stands in for the model."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import pytest
from batchfleet.batching.gen_types import GenPolicy
from batchfleet.schemas.codec import decode_result
from batchfleet.schemas.messages import Request
from batchfleet.worker.gen_scheduler import GenScheduler
from batchfleet.worker.holding import Holding, entries_to_refresh
from batchfleet.worker.inbox import Cancel, Lost
from batchfleet.worker.observers import BatchDone, Dispatched
from batchfleet.worker.runner import (
    LOST,
    Failed,
    Final,
    Partial,
    Preempted,
    Prepared,
    PrepareError,
    Progress,
    StepEvent,
    StepReport,
    Work,
)
from batchfleet.worker.sink import MemorySink
from virtual_world import MODEL, T0, Rig, rig

STEP_S = 0.010
AHEAD = [False]
"""Whether the scripted runner asks the loop to plan each step while one runs (each test
runs both ways, see ``ahead``)."""


@pytest.fixture(autouse=True, params=[False, True], ids=["in-turn", "ahead"])
def ahead(request: pytest.FixtureRequest) -> Iterator[bool]:
    AHEAD[0] = request.param
    yield request.param
    AHEAD[0] = False


@dataclass
class _Run:
    prompts: list[int]
    max_new: int
    made: int = 0
    stream: bool = False
    sent: int = 0
    """Tokens streamed so far."""


@dataclass
class Tokens:
    """A scripted generator: a prompt's tokens are its words; each step every running
    sequence makes one token ``t<k>``, up to ``max_new_tokens`` (then ``length``)."""

    kv_cache_tokens: int = 4096
    page_size: int = 16
    step_tokens: int = 256
    max_running: int = 16
    fail_at_step: int | None = None
    oom_at_step: int | None = None
    """This step runs out of memory: every running request is parked (as the real runner
    does), reported preempted."""
    crash_at_step: int | None = None
    """This step raises once it ran: its events (but for the requests it admitted) come
    first in the next step's, as the real runner carries them over (``Unsent``)."""
    hold_back: bool = False
    """A streaming request's last token is held back till its end (a detokenizer that
    waits to see a stop string): its end comes with a last delta."""
    name: str = "tokens"
    device: str = "cpu"
    continuous: bool = True
    schedule_ahead: bool = field(default_factory=lambda: AHEAD[0])
    steps: list[Work] = field(default_factory=list)
    forgotten: int = 0
    ignored: list[str] = field(default_factory=list)
    """Stops and preemptions of requests already ended or freed (planned ahead only)."""
    running: dict[str, _Run] = field(default_factory=dict)
    parked: dict[str, _Run] = field(default_factory=dict)
    tells: bool = False
    """Report each step's tokens (``StepReport.produced``) as the real runner does; else
    the loop takes the first delta or result as the first token."""
    unsent: list[StepEvent] = field(default_factory=list)
    """The events of the step that raised (``crash_at_step``)."""

    def generation_policy(self, lanes: int, weights: tuple[float, ...], starve: float) -> GenPolicy:
        return GenPolicy(kv_cache_tokens=self.kv_cache_tokens, page_size=self.page_size,
                         step_tokens=self.step_tokens, max_running=self.max_running,
                         lanes=lanes, lane_weights=weights, max_starvation_ms=starve)  # fmt: skip

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | PrepareError]:
        out: list[Prepared | PrepareError] = []
        for r in requests:
            prompts = [len(t.split()) for t in r.inputs] or [3]
            spec = _Run(prompts, r.max_new_tokens or 5, stream=bool(r.stream))
            out.append(Prepared(spec, rows=len(prompts), tokens=max(prompts),
                                prompts=tuple(prompts), max_new_tokens=spec.max_new))  # fmt: skip
        return out

    def step(self, work: Work) -> StepReport:
        self.steps.append(work)
        if self.fail_at_step is not None and len(self.steps) == self.fail_at_step:
            events: list[StepEvent] = [Failed(k, "boom") for k in self.running]
            events += [Failed(k, "boom") for k, _ in work.admit if k not in self.running]
            self.running.clear()
            return StepReport(events)
        lost = {key for key, reason in work.stop if reason == LOST}
        events = [ev for ev in self.unsent if ev.key not in lost]
        self.unsent = []
        for key, reason in work.stop:
            run = self.running.pop(key, None) or self.parked.pop(key, None)
            if run is None and self.schedule_ahead:  # it ended in the step before
                self.ignored.append(key)
                continue
            assert run is not None, key
            if reason != LOST:
                events += self._deltas(key, run, end=True)
            events.append(self._final(key, run, reason))
        for key in work.preempt:
            run = self.running.pop(key, None)
            if run is None and (self.schedule_ahead and key not in self.parked):
                self.ignored.append(key)
                continue
            assert run is not None, key
            self.parked[key] = run
            events.append(Preempted(key, tuple(p + run.made for p in run.prompts),
                                    run.max_new - run.made))  # fmt: skip
        for key, prep in work.admit:
            self.running[key] = self.parked.pop(key, None) or _Run(**vars(prep.payload))
        if self.oom_at_step is not None and len(self.steps) == self.oom_at_step:
            for key, run in self.running.items():
                self.parked[key] = run
                events.append(Preempted(key, tuple(p + run.made for p in run.prompts),
                                        run.max_new - run.made))  # fmt: skip
            self.running.clear()
            return StepReport(events, out_of_memory=True)
        progress: dict[str, Progress] = {}
        produced: dict[str, int] = {}
        for key, run in list(self.running.items()):
            run.made += 1
            produced[key] = len(run.prompts)
            events += self._deltas(key, run, end=run.made >= run.max_new)
            if run.made >= run.max_new:
                del self.running[key]
                events.append(self._final(key, run, "length"))
            else:
                ctx = tuple(p + run.made for p in run.prompts)
                progress[key] = Progress(ctx, tuple(0 for _ in ctx), run.max_new - run.made)
        if len(self.steps) == self.crash_at_step:
            admitted = {key for key, _ in work.admit}
            self.unsent = [ev for ev in events if ev.key not in admitted]
            raise RuntimeError("runner bug once the step ran")
        if not self.tells:
            return StepReport(events, progress=progress)
        return StepReport(events, progress=progress, produced=produced)

    def _deltas(self, key: str, run: _Run, *, end: bool) -> list[StepEvent]:
        """A streaming request's tokens not streamed yet, one delta per input (the last
        one held back, ``hold_back``, till its ``end``)."""
        upto = run.made if end or not self.hold_back else run.made - 1
        if not run.stream or upto <= run.sent:
            return []
        text = "".join(f" t{k}" for k in range(run.sent + 1, upto + 1))
        chunk = {"text": text, "tokens": upto - run.sent}
        run.sent = upto
        return [Partial(key, {"input": i, **chunk}) for i in range(len(run.prompts))]

    def _final(self, key: str, run: _Run, reason: str) -> Final:
        text = "".join(f" t{k}" for k in range(1, run.made + 1))
        return Final(
            key,
            [
                {
                    "text": text,
                    "finish_reason": reason,
                    "prompt_tokens": p,
                    "completion_tokens": run.made,
                    "cached_tokens": p // 16 * 16 // 2,
                }
                for p in run.prompts
            ],
        )  # fmt: skip (half its whole blocks "cached")

    def info(self) -> dict[str, Any]:
        return {"runner": self.name}

    def forget_all(self) -> None:
        self.forgotten += 1
        self.running.clear()
        self.parked.clear()


def gen_rig(runner: Tokens | None = None, **kw: Any) -> tuple[Rig, Tokens]:
    runner = runner or Tokens()
    r = rig(runner, cost=lambda work: STEP_S, **kw)  # type: ignore[arg-type]
    return r, runner


def submit(r: Rig, rid: str, text: str = "a b c", *, at: float | None = None, lane: int = 1,
           **fields: Any) -> str:  # fmt: skip
    req = Request(id=rid, model=MODEL, inputs=[text], **fields)
    r.source.add(req, lane=lane, at=at)
    return rid


def outputs(r: Rig, rid: str) -> dict[str, Any]:
    res = r.result(rid)
    assert res.status == "ok", res
    assert res.outputs is not None
    out: dict[str, Any] = res.outputs[0]
    return out


def test_requests_join_between_steps_and_leave_when_done() -> None:
    r, runner = gen_rig()
    submit(r, "a", max_new_tokens=6)
    submit(r, "b", max_new_tokens=2, at=T0 + 0.025)  # joins the running batch
    submit(r, "c", max_new_tokens=3, at=T0 + 0.200)  # arrives when all is done
    r.run()
    assert outputs(r, "a")["completion_tokens"] == 6
    assert outputs(r, "b")["completion_tokens"] == 2 and outputs(r, "c")["text"] == " t1 t2 t3"
    admitted = [[k for k, _ in w.admit] for w in runner.steps]
    assert [len(a) for a in admitted].count(1) == 3  # each joined alone, at the next step
    assert admitted[0] and not admitted[1]  # b arrives during the third step at the earliest
    b_step = next(i for i, a in enumerate(admitted) if a and i > 0)
    assert 1 < b_step < 6  # while a still runs: no waiting for a's end
    res = r.result("b")
    assert res.usage is not None and res.usage.completion_tokens == 2
    assert res.timings.first_token_ms is not None and res.timings.first_token_ms > 0
    # step events reach observers (metrics) like batches do
    assert len(r.recorder.of(BatchDone)) == len(runner.steps)


def test_the_intake_is_told_which_requests_wait_or_run_until_they_end() -> None:
    r, _ = gen_rig(Tokens(max_running=1))
    long = r.source.add(Request(id="long", model=MODEL, inputs=["a b"], max_new_tokens=30))
    short = r.source.add(Request(id="short", model=MODEL, inputs=["a"], max_new_tokens=20))
    seen: dict[float, set[str]] = {}
    for t in (0.15, 0.45):  # the intake's view lags up to HAND_OVER_EVERY_S (0.1 s)
        r.world.at(T0 + t, lambda t=t: seen.__setitem__(t, {e.key for e in r.source.held}))
    r.run()
    # running (30 steps of 10 ms) and waiting, then only the one that still runs (20 more)
    assert seen == {0.15: {long.key, short.key}, 0.45: {short.key}}
    assert r.source.held == ()


def test_a_generation_longer_than_claim_idle_ms_is_refreshed_throughout() -> None:
    # Given a generation of 300 steps of 10 ms, the idle fallback at 400 ms
    r, _ = gen_rig(Tokens(max_running=1), worker={"claim_idle_ms": 400})
    long = r.source.add(Request(id="long", model=MODEL, inputs=["a b"], max_new_tokens=300))
    refreshed: list[bool] = []
    for i in range(1, 60):  # every 50 ms, up to 2.95 s

        def look() -> None:
            entries = entries_to_refresh(r.source.holding, r.world.now, 400)
            refreshed.append(long in entries)

        r.world.at(T0 + i * 0.05, look)
    r.run()
    # Then the intake never takes its device for hung: each step is short
    assert refreshed == [True] * 59
    assert outputs(r, "long")


def test_a_step_hung_past_claim_idle_ms_is_reported_until_it_ends() -> None:
    # Given a generation of 10 ms steps whose fifth step hangs for 1 s (about 0.04-1.04 s),
    # the idle fallback at 400 ms
    steps = iter(range(10_000))
    r = rig(Tokens(max_running=1), cost=lambda work: 1.0 if next(steps) == 4 else STEP_S,
            worker={"claim_idle_ms": 400})  # fmt: skip
    submit(r, "long", max_new_tokens=60)  # ends at about 1.6 s
    seen: dict[float, float | None] = {}
    for t in (0.03, 0.3, 0.6, 1.0, 1.3):
        r.world.at(T0 + t, lambda t=t: seen.__setitem__(t, r.loop.hung_for()))
    r.run()
    # Then the worker reports its device hung (for /livez) only once the step has run past
    # claim_idle_ms, with how long it has run, and no longer once it ended
    assert seen[0.03] is None and seen[0.3] is None
    assert seen[0.6] is not None and 0.5 <= seen[0.6] <= 0.6
    assert seen[1.0] is not None and 0.9 <= seen[1.0] <= 1.0
    assert seen[1.3] is None
    assert outputs(r, "long")["completion_tokens"] == 60


def test_deltas_are_numbered_and_end_after_the_result() -> None:
    r, _ = gen_rig()
    submit(r, "s", max_new_tokens=4, stream=True)
    submit(r, "q", max_new_tokens=4)
    r.run()
    sent = r.sink.streamed["s"]
    assert [it.seq for it in sent] == [1, 2, 3, 4, 5]
    assert [it.delta.text for it in sent[:4] if it.delta] == [" t1", " t2", " t3", " t4"]
    assert sent[-1].delta is None  # the end entry, after the result
    assert "q" not in r.sink.streamed
    assert outputs(r, "s")["text"] == "".join(it.delta.text for it in sent if it.delta)


def test_deadline_before_start_expires_and_mid_generation_stops() -> None:
    runner = Tokens(max_running=1)
    r, _ = gen_rig(runner)
    submit(r, "long", max_new_tokens=50, deadline_ms=200)
    submit(r, "behind", max_new_tokens=5, deadline_ms=100, stream=True)  # no slot in time
    r.run()
    out = outputs(r, "long")
    assert out["finish_reason"] == "deadline"
    assert 15 <= out["completion_tokens"] < 50  # it ran until its deadline, about 20 steps
    assert r.result("behind").status == "expired"
    (end,) = r.sink.streamed["behind"]  # its token stream ends, though nothing streamed
    assert end.delta is None and end.seq == 1
    # Every answer is stored as this attempt's (finish.lua's fence), a streaming one's
    # with its stream's end, written in the same call
    sent = {a.result.id: a for batch in r.sink.sent for a in batch}
    assert sent["long"].fenced and sent["long"].end is None
    assert sent["behind"].fenced and sent["behind"].end is not None
    assert sent["behind"].end.seq == 1 and sent["behind"].end.life == -1


def test_cancel_answers_a_waiting_request_now_and_stops_a_running_one() -> None:
    runner = Tokens(max_running=1)
    r, _ = gen_rig(runner)
    submit(r, "run", max_new_tokens=100, stream=True)
    submit(r, "wait", max_new_tokens=5, n=2)
    r.world.at(T0 + 0.055, lambda: r.loop.parts.inbox.put(Cancel(("wait", "run"))))
    r.run()
    w = outputs(r, "wait")
    assert w["finish_reason"] == "cancelled" and w["text"] == ""
    assert len(r.result("wait").outputs or ()) == 2  # one per completion (n)
    out = outputs(r, "run")
    assert out["finish_reason"] == "cancelled"
    assert 4 <= out["completion_tokens"] <= 7
    assert r.sink.streamed["run"][-1].delta is None  # its token stream ended


def test_lane0_preempts_a_lower_lane_and_it_resumes_without_loss() -> None:
    # room for about one request: a lane-2 one runs, then a lane-0 one arrives
    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=4)
    r, _ = gen_rig(runner)
    submit(r, "low", "w " * 20, lane=2, max_new_tokens=20, stream=True)
    submit(r, "high", "w " * 40, lane=0, max_new_tokens=5, at=T0 + 0.052)
    r.run()
    preempts = [w for w in runner.steps if w.preempt]
    assert [len(w.preempt) for w in preempts] == [1]
    assert preempts[0].preempt[0].startswith("2/")  # the lane-2 request's entry
    low, high = outputs(r, "low"), outputs(r, "high")
    assert low["completion_tokens"] == 20 and high["completion_tokens"] == 5
    assert low["text"] == "".join(f" t{k}" for k in range(1, 21))
    # high ended before low did; low's deltas carry on numbering after the preemption
    assert r.sink.results and list(r.sink.results).index("high") < list(r.sink.results).index("low")
    assert [it.seq for it in r.sink.streamed["low"]] == list(range(1, 22))


def test_a_request_is_marked_started_when_admitted_not_while_it_waits() -> None:
    # Given room for one request at a time: "first" runs, "next" waits for its slot, and
    # a lane-0 request later preempts "next", which resumes after it
    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=1)
    r, _ = gen_rig(runner)
    submit(r, "first", max_new_tokens=3, stream=True)
    submit(r, "next", "w " * 20, lane=2, max_new_tokens=20, stream=True)
    submit(r, "high", "w " * 40, lane=0, max_new_tokens=2, at=T0 + 0.062)
    marked: list[tuple[str, bool, int]] = []
    """(id, its deltas streamed yet, steps begun) at each mark"""
    mark = r.sink.started

    def started(items: Sequence[tuple[str, int]]) -> None:
        for rid, ttl in items:
            assert ttl == 3600  # the result's
            marked.append((rid, rid in r.sink.streamed, len(runner.steps)))
        mark(items)

    r.sink.started = started  # type: ignore[method-assign]
    # When the loop runs them all
    r.run()
    # Then each is marked once, when the step admitting it is dispatched: before its
    # first token; "next" not while it waited, nor again when it resumed
    assert [w.preempt for w in runner.steps if w.preempt]  # it was preempted
    assert [(rid, streamed) for rid, streamed, _ in marked] == [
        ("first", False), ("next", False), ("high", False)]  # fmt: skip
    # (the device began the step that admits it: "first" step 1, "next" after first's 3)
    assert [steps for *_, steps in marked][:2] == [1, 4] and marked[2][2] > 4
    assert r.sink.started_ids == ["first", "next", "high"]
    assert outputs(r, "next")["completion_tokens"] == 20


def test_the_policy_sees_how_often_a_running_request_was_preempted() -> None:
    # (lane 0 may preempt a request that starvation promotion admitted once, not twice)
    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=4)
    r, _ = gen_rig(runner)
    policy = r.loop.scheduler.policy  # type: ignore[union-attr]
    seen: list[tuple[int, ...]] = []
    plan = policy.plan

    def spy(waiting: Any, running: Any, now: float) -> Any:
        seen.append(tuple(g.preempted for g in running if g.lane == 2))
        return plan(waiting, running, now)

    policy.plan = spy
    submit(r, "low", "w " * 20, lane=2, max_new_tokens=20, stream=True)
    submit(r, "high", "w " * 40, lane=0, max_new_tokens=5, at=T0 + 0.052)
    r.run()
    assert any(w.preempt for w in runner.steps)
    assert (0,) in seen and (1,) in seen
    assert seen.index((1,)) > max(i for i, s in enumerate(seen) if s == (0,))


def test_a_preempted_request_cancelled_while_waiting_keeps_its_text() -> None:
    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=4)
    r, _ = gen_rig(runner)
    submit(r, "low", "w " * 20, lane=2, max_new_tokens=20, stream=True)
    submit(r, "high", "w " * 40, lane=0, max_new_tokens=20, at=T0 + 0.052)
    r.world.at(T0 + 0.1, lambda: r.loop.parts.inbox.put(Cancel(("low",))))
    r.run()
    assert any(w.preempt for w in runner.steps)
    low = outputs(r, "low")
    assert low["finish_reason"] == "cancelled" and 4 <= low["completion_tokens"] <= 7
    sent = r.sink.streamed["low"]
    assert [it.seq for it in sent] == list(range(1, len(sent) + 1)) and sent[-1].delta is None
    assert outputs(r, "high")["completion_tokens"] == 20


def test_a_request_cancelled_while_its_preemption_runs_ends_cancelled_with_its_text() -> None:
    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=4)
    r, _ = gen_rig(runner)
    submit(r, "low", "w " * 20, lane=2, max_new_tokens=20, stream=True)
    submit(r, "high", "w " * 40, lane=0, max_new_tokens=20, at=T0 + 0.052)
    step = runner.step

    def cancel_mid_preemption(work: Work) -> StepReport:
        if work.preempt:  # the client cancels while the step that preempts it runs
            r.world.at(r.world.now + STEP_S / 2, lambda: r.loop.parts.inbox.put(Cancel(("low",))))
        return step(work)

    runner.step = cancel_mid_preemption  # type: ignore[method-assign]
    r.run()
    low = outputs(r, "low")  # not generated again from its prompt once parked
    assert low["finish_reason"] == "cancelled" and low["completion_tokens"] < 20
    sent = r.sink.streamed["low"]
    assert [it.seq for it in sent] == list(range(1, len(sent) + 1)) and sent[-1].delta is None
    assert outputs(r, "high")["completion_tokens"] == 20


def test_budgets_changed_live_shrink_the_running_batch_and_reach_the_runner() -> None:
    from dataclasses import replace

    from batchfleet.worker.inbox import SetPolicy

    r, runner = gen_rig(Tokens(max_running=8))
    for i in range(6):
        submit(r, f"g{i}", max_new_tokens=30)
    budgets = r.loop.budgets
    assert budgets is not None and r.loop.configured_budgets == budgets
    smaller = replace(budgets, max_running=2, step_tokens=128)
    r.world.at(T0 + 0.2, lambda: r.loop.parts.inbox.put(SetPolicy(smaller)))
    running: list[int] = []
    step = runner.step

    def counted(work: Work) -> StepReport:
        report = step(work)
        running.append(len(runner.running))
        return report

    runner.step = counted  # type: ignore[method-assign]
    r.run()
    changed = [w.step_tokens for w in runner.steps if w.step_tokens is not None]
    assert changed == [128]  # once, with the first step after the change
    at = next(i for i, w in enumerate(runner.steps) if w.step_tokens is not None)
    assert max(running[:at]) == 6 and max(running[at:]) <= 2  # the excess was preempted
    assert all(outputs(r, f"g{i}")["completion_tokens"] == 30 for i in range(6))
    assert r.loop.budgets == smaller


def test_a_failed_step_fails_what_ran_and_the_loop_goes_on() -> None:
    runner = Tokens(fail_at_step=3)
    r, _ = gen_rig(runner)
    submit(r, "x", max_new_tokens=10)
    submit(r, "y", max_new_tokens=10)
    submit(r, "z", max_new_tokens=2, at=T0 + 0.5)
    r.run()
    assert r.result("x").status == "error" and r.result("y").status == "error"
    assert outputs(r, "z")["completion_tokens"] == 2


def test_stopping_lets_running_generations_end_and_hands_back_waiting_ones() -> None:
    runner = Tokens(max_running=1)
    r, _ = gen_rig(runner, burst=False)
    submit(r, "run", max_new_tokens=8)
    submit(r, "wait", max_new_tokens=8)
    r.world.at(T0 + 0.03, r.loop.stop)
    r.run()
    assert outputs(r, "run")["completion_tokens"] == 8
    assert "wait" not in r.sink.results
    (released,) = r.source.released
    assert b"wait" in next(iter(released.fields.values()))  # the waiting one went back


def test_generations_past_the_shutdown_grace_go_back_to_the_fleet() -> None:
    r, _ = gen_rig(burst=False, worker={"shutdown_grace_s": 0.05})
    submit(r, "endless", max_new_tokens=1000)
    r.world.at(T0 + 0.03, r.loop.stop)
    r.run()
    assert "endless" not in r.sink.results
    assert len(r.source.released) == 1


@pytest.mark.parametrize("field_", ["messages", "max_new_tokens"])
def test_encoder_models_answer_generation_requests_invalid(field_: str) -> None:
    r = rig()
    extra: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}], "inputs": []}
        if field_ == "messages" else {"max_new_tokens": 3}
    )  # fmt: skip
    req = Request(id="g", model=MODEL, **{"inputs": ["a b"], **extra})
    r.source.add(req)
    r.run()
    res = r.result("g")
    assert res.status == "error" and res.error is not None
    assert res.error.code == "invalid_request" and field_ in res.error.message


def test_a_request_that_outgrows_the_whole_cache_ends_with_length() -> None:
    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=4)
    r, _ = gen_rig(runner)
    submit(r, "big", "w " * 40, max_new_tokens=100)
    r.run()
    out = outputs(r, "big")
    assert out["finish_reason"] == "length"
    assert 40 + out["completion_tokens"] <= 64


def preempting_run(tells: bool = False) -> tuple[Rig, Callable[..., float | None]]:
    """A lane-2 request preempted for a lane-0 one; the run's loop events fed to a fresh
    metrics registry, and a reader of its samples (``value(name, **labels)``)."""
    from batchfleet.worker.metrics import Metrics, PrometheusObserver
    from prometheus_client import CollectorRegistry

    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=4, tells=tells)
    r, _ = gen_rig(runner)
    submit(r, "low", "w " * 20, lane=2, max_new_tokens=20)
    submit(r, "high", "w " * 40, lane=0, max_new_tokens=5, at=T0 + 0.052)
    r.run()
    registry = CollectorRegistry()
    obs = PrometheusObserver(Metrics(registry))
    for _, ev in r.recorder.events:
        obs.notify(ev)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model": MODEL, **labels})

    return r, value


def test_generation_metrics_and_stats() -> None:
    r, value = preempting_run()

    assert value("batchfleet_generated_tokens_total") == 25
    # the prompts' tokens, and the "cached" ones the scripted runner reports (half their
    # whole blocks of 16: 20 -> 8, 40 -> 16)
    assert (
        value("batchfleet_prompt_tokens_total"),
        value("batchfleet_prompt_cached_tokens_total"),
    ) == (60, 24)
    assert value("batchfleet_preemptions_total") == 1
    assert value("batchfleet_time_to_first_token_seconds_count", lane="0") == 1
    assert value("batchfleet_generation_running_sequences") == 0  # all done at the end
    assert value("batchfleet_kv_cache_usage_ratio") == 0
    stats = r.loop.stats.snapshot()["generation"]
    assert stats["completion_tokens"] == 25 and stats["preemptions"] == 1
    assert value("batchfleet_constraints_compiling") == 0


def test_constraint_compile_metrics() -> None:
    from batchfleet.worker.metrics import Metrics, PrometheusObserver
    from batchfleet.worker.observers import Generated
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    obs = PrometheusObserver(Metrics(registry))
    obs.notify(Generated(MODEL, 3, 0, 100, 1000, 0, compiling=2, compiled_s=(0.004, 0.03)))
    obs.notify(Generated(MODEL, 3, 0, 100, 1000, 0, compiling=1))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model": MODEL, **labels})

    assert value("batchfleet_constraints_compiling") == 1
    assert value("batchfleet_constraint_compile_seconds_count") == 2
    assert value("batchfleet_constraint_compile_seconds_bucket", le="0.005") == 1
    assert value("batchfleet_constraint_compile_seconds_sum") == pytest.approx(0.034)


def test_first_token_time_is_its_first_step_s_end_streaming_or_not() -> None:
    r, _ = gen_rig(Tokens(tells=True))
    submit(r, "quiet", max_new_tokens=10)  # steps 1-10
    submit(r, "streamed", max_new_tokens=10, stream=True, at=T0 + 0.001)  # from step 2
    submit(r, "short", max_new_tokens=1, at=T0 + 0.001)  # step 2
    r.run()
    step_ms = STEP_S * 1000
    firsts = {rid: r.result(rid).timings.first_token_ms for rid in ("quiet", "streamed", "short")}
    assert firsts == pytest.approx(
        {"quiet": step_ms, "streamed": 2 * step_ms - 1, "short": 2 * step_ms - 1}
    )
    assert r.result("quiet").timings.total_ms == pytest.approx(10 * step_ms)
    # its ten steps, and it waited for the first from its read (planned ahead too: the
    # step that admitted it was queued behind the first one)
    t = r.result("streamed").timings
    assert (t.batch_wait_ms, t.inference_ms) == pytest.approx((step_ms - 1, 10 * step_ms))


def test_per_request_metrics_read_vllms_moments_off_a_generations_timings() -> None:
    from batchfleet.producer.gateway.frontend import timing_metrics

    # Given a request read during step 1, scheduled into step 2 (its first token at its
    # end), generating 10 tokens, one a step
    r, _ = gen_rig(Tokens(tells=True))
    submit(r, "quiet", max_new_tokens=10)
    submit(r, "streamed", max_new_tokens=10, stream=True, at=T0 + 0.001)
    r.run()
    step_ms = STEP_S * 1000
    # Then vLLM's metrics measure from its moments: scheduled (its first step's start),
    # first token (that step's end), last token (its tenth step's end)
    assert timing_metrics(r.result("streamed")) == pytest.approx({
        "queue_time_ms": step_ms - 1, "time_to_first_token_ms": step_ms,
        "generation_time_ms": 9 * step_ms, "mean_itl_ms": step_ms,
        "tokens_per_second": 10 / (10 * STEP_S),
    })  # fmt: skip


def test_inter_token_latency_and_step_tokens_metrics() -> None:
    # the lane-2 request is preempted for the lane-0 one: its gap across that is long
    r, value = preempting_run(tells=True)
    assert value("batchfleet_step_generated_tokens_total") == 25
    itl = "batchfleet_inter_token_latency_seconds"
    # every token after a request's first closes one gap
    assert value(f"{itl}_count", lane="0") == 4
    assert value(f"{itl}_sum", lane="0") == pytest.approx(4 * STEP_S)
    assert value(f"{itl}_count", lane="2") == 19
    gaps = value(f"{itl}_sum", lane="2")
    # one gap spans the preemption: the lane-0 request's five steps at least
    assert gaps is not None and gaps >= 18 * STEP_S + 6 * STEP_S - 1e-9
    assert value(f"{itl}_bucket", lane="2", le="0.05") == 18  # the step-to-step ones
    assert r.loop.stats.snapshot()["generation"]["completion_tokens"] == 25


def test_the_recent_rate_counts_generated_tokens() -> None:
    from batchfleet.worker.control import RecentRate

    r, _ = gen_rig(Tokens(tells=True))
    rate = RecentRate(clock=lambda: r.world.now)
    r.loop.observers.observers.append(rate)
    for k in range(3):
        submit(r, f"r{k}", max_new_tokens=10, at=T0 + 0.02 * k)
    r.run()
    span = r.world.now - T0
    assert rate.snapshot()["tokens_per_s"] == pytest.approx(30 / span, abs=0.05)


def test_a_lane0_request_is_read_while_lower_lanes_fill_the_hold() -> None:
    # two slots, and the worker holds at most twice that: lane-2 requests fill it all
    runner = Tokens(max_running=2)
    r, _ = gen_rig(runner)
    for k in range(8):
        submit(r, f"low{k}", "w w", lane=2, max_new_tokens=40)
    submit(r, "high", "w w", lane=0, max_new_tokens=3, at=T0 + 0.05)
    r.run()
    order = list(r.sink.results)
    # it was read at once and preempted a lane-2 one: it ends before any of them
    assert order[0] == "high"
    assert all(outputs(r, f"low{k}")["completion_tokens"] == 40 for k in range(8))


def test_planned_ahead_the_next_step_waits_on_the_device_before_one_ends(ahead: bool) -> None:
    r, _ = gen_rig()
    for k in range(4):
        submit(r, f"r{k}", max_new_tokens=8, at=T0 + 0.013 * k)
    submitted: dict[str, float] = {}
    submit_ = r.device.submit

    def stamped(work: Work) -> None:
        submitted[work.step_id] = r.world.now
        submit_(work)

    r.device.submit = stamped  # type: ignore[method-assign]
    r.run()
    spans = r.device.spans
    queued = [submitted[b.step_id] < a.end for a, b in pairwise(spans) if b.start == a.end]
    assert len(queued) >= 8  # back-to-back steps
    assert all(queued) if ahead else not any(queued)
    assert all(outputs(r, f"r{k}")["completion_tokens"] == 8 for k in range(4))
    # observers hear of each step as it starts, once
    started = [(t, e.batch_id) for t, e in r.recorder.of(Dispatched)]
    assert started == [(sp.start, sp.step_id) for sp in spans]


def _streamed_whole(r: Rig, rid: str) -> dict[str, Any]:
    """``rid``'s result; its deltas, numbered 1, 2, ... without a gap or a repeat, then
    its end, add up to its text."""
    out = outputs(r, rid)
    sent = r.sink.streamed[rid]
    assert [it.seq for it in sent] == list(range(1, len(sent) + 1)) and sent[-1].delta is None
    assert "".join(it.delta.text for it in sent if it.delta) == out["text"]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_every_request_ends_once_with_all_its_tokens_whatever_the_plan(seed: int) -> None:
    # lanes competing for a small cache (preemption), cancellations and deadlines, both ways
    # (odd seeds: each stream's last token held back till its end)
    rng = random.Random(seed)
    runner = Tokens(kv_cache_tokens=256, page_size=16, max_running=6, step_tokens=64,
                    hold_back=seed % 2 == 1)  # fmt: skip
    r, _ = gen_rig(runner)
    wanted: dict[str, int] = {}
    for k in range(30):
        rid = f"q{k}"
        wanted[rid] = rng.randint(1, 25)
        extra: dict[str, Any] = {"stream": rng.random() < 0.5}
        if rng.random() < 0.15:
            extra["deadline_ms"] = rng.randint(20, 400)
        submit(r, rid, "w " * rng.randint(1, 40), lane=rng.choice((0, 1, 2)),
               max_new_tokens=wanted[rid], at=T0 + rng.uniform(0, 0.5), **extra)  # fmt: skip
        if rng.random() < 0.15:
            when = T0 + rng.uniform(0, 0.8)
            r.world.at(when, lambda rid=rid: r.loop.parts.inbox.put(Cancel((rid,))))
    r.run()
    results = r.results()
    assert set(results) == set(wanted)  # every one answered (the sink stores each once)
    for rid, want in wanted.items():
        res = results[rid]
        if res.status != "ok":
            assert res.status == "expired", res
            continue
        assert res.outputs is not None
        out = res.outputs[0]
        made = out["completion_tokens"]
        assert out["text"] == "".join(f" t{k}" for k in range(1, made + 1))  # none lost
        if out["finish_reason"] == "length":
            assert made == want
        else:
            assert out["finish_reason"] in ("cancelled", "deadline") and made <= want
        if rid in r.sink.streamed:
            _streamed_whole(r, rid)
    assert not runner.running and not runner.parked


def test_a_request_its_runner_parks_while_a_stop_for_it_is_queued_ends_once(ahead: bool) -> None:
    # step 4 runs out of memory (the runner parks what runs); the client cancelled during
    # step 3, so planned ahead, step 5 (queued before step 4's report) carries the stop
    runner = Tokens(oom_at_step=4)
    r, _ = gen_rig(runner)
    submit(r, "a", max_new_tokens=30, stream=True)
    r.world.at(T0 + 0.025, lambda: r.loop.parts.inbox.put(Cancel(("a",))))
    r.run()
    out = outputs(r, "a")
    assert out["finish_reason"] == "cancelled"
    assert out["text"] == "".join(f" t{k}" for k in range(1, out["completion_tokens"] + 1))
    assert out["completion_tokens"] <= 3
    assert not runner.running and not runner.parked
    assert len([k for w in runner.steps for k, _ in w.admit]) == 1  # never started again


@pytest.mark.parametrize("parks", ["policy", "runner"])
def test_a_parked_request_stopped_streams_the_delta_it_ends_with_before_its_end(
    parks: str,
) -> None:
    # Given a streaming request whose last token is held back till its end, parked: for a
    # lane-0 one (policy), or by its runner out of memory in step 4, during which the
    # client cancels (planned ahead: step 5, queued before step 4's report, carries it)
    if parks == "policy":
        runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=4, hold_back=True)
        r, _ = gen_rig(runner)
        submit(r, "low", "w " * 20, lane=2, max_new_tokens=20, stream=True)
        submit(r, "high", "w " * 40, lane=0, max_new_tokens=20, at=T0 + 0.052)
        cancel_at = T0 + 0.1
    else:
        runner = Tokens(oom_at_step=4, hold_back=True)
        r, _ = gen_rig(runner)
        submit(r, "low", max_new_tokens=30, stream=True)
        cancel_at = T0 + 0.035
    # When the client cancels it, parked (a step that admits nothing stops it)
    r.world.at(cancel_at, lambda: r.loop.parts.inbox.put(Cancel(("low",))))
    r.run()
    # Then the delta it ends with is streamed, numbered on, and its end follows it
    low = _streamed_whole(r, "low")
    assert low["finish_reason"] == "cancelled" and low["completion_tokens"] >= 2
    assert (parks == "runner") or any(w.preempt for w in runner.steps)
    assert len([k for w in runner.steps for k, _ in w.admit]) == 1 + (parks == "policy")
    assert not runner.running and not runner.parked  # (never resumed)


def test_a_delta_carried_over_with_its_preemption_is_counted_before_it_resumes() -> None:
    # Given a streaming request whose step 3 raises once it ran (its delta carried over
    # into step 4) and step 4 runs out of memory (the request parked in the step that
    # streams that delta)
    runner = Tokens(crash_at_step=3, oom_at_step=4)
    r, _ = gen_rig(runner)
    submit(r, "a", max_new_tokens=8, stream=True)
    r.run()
    # Then, resumed, it numbers on after that delta: no seq repeats (a reader's restart)
    assert len([k for w in runner.steps for k, _ in w.admit]) == 2  # (parked, resumed)
    out = _streamed_whole(r, "a")
    assert out["completion_tokens"] == 8


def _lane0_and_cancel(ahead: bool) -> tuple[Rig, Tokens]:
    runner = Tokens(schedule_ahead=ahead)
    r, _ = gen_rig(runner)
    submit(r, "low", max_new_tokens=20, lane=2)
    submit(r, "gone", max_new_tokens=20, lane=1, stream=True)
    submit(r, "high", max_new_tokens=3, lane=0, at=T0 + 0.045)  # mid-step
    submit(r, "mid", max_new_tokens=4, lane=1, at=T0 + 0.103)  # mid-step, a slot free
    r.world.at(T0 + 0.075, lambda: r.loop.parts.inbox.put(Cancel(("gone",))))
    r.run()
    return r, runner


def test_an_arrival_that_may_join_or_a_cancel_replans_the_queued_step() -> None:
    # planned ahead, an arrival that may join (lane 0, or any while a slot is free) or a
    # cancel withdraws the queued step (not started) and plans it again: each reaches the
    # device with the next step, as in turn
    (turn, by_turn), (ahead, by_ahead) = _lane0_and_cancel(False), _lane0_and_cancel(True)
    for rid in ("low", "gone", "high", "mid"):
        assert outputs(ahead, rid) == outputs(turn, rid)
    assert outputs(ahead, "gone")["finish_reason"] == "cancelled"

    assert [len(w.admit) for w in by_ahead.steps] == [len(w.admit) for w in by_turn.steps]
    assert [w.stop for w in by_ahead.steps] == [w.stop for w in by_turn.steps]
    assert len(by_ahead.steps) == len(by_turn.steps)  # no step ran twice nor was lost
    started = [e.batch_id for _, e in ahead.recorder.of(Dispatched)]
    assert started == [sp.step_id for sp in ahead.device.spans]  # withdrawn ones unheard of


def test_a_replan_leaves_the_step_before_the_queued_one_to_run_when_not_yet_started() -> None:
    # the device thread takes the next step a little after posting the last one: the loop
    # may already have queued the one after; a lane-0 arrival then finds both waiting
    runner = Tokens(schedule_ahead=True)
    r, _ = gen_rig(runner)
    r.device.lag = 0.004
    submit(r, "a", max_new_tokens=12, lane=1)
    for k in range(12):  # one in each lag window at least (steps of 10 ms + 4 ms)
        submit(r, f"h{k}", max_new_tokens=2, lane=0, at=T0 + 0.011 + 0.0117 * k)
    r.run()
    assert outputs(r, "a")["completion_tokens"] == 12
    assert all(outputs(r, f"h{k}")["completion_tokens"] == 2 for k in range(12))
    ran = [sp.step_id for sp in r.device.spans]
    assert len(ran) == len(set(ran)) == len(runner.steps)  # none lost, none run twice


def test_a_generating_loop_restarted_after_a_crash_serves_again() -> None:
    # (worker/app.py restarts a crashed loop through reset(): it must come back generating)
    runner = Tokens(max_running=4)
    r, _ = gen_rig(runner)
    runner.running["old"] = _Run([3], 50, 3)  # running when the loop crashed
    r.loop.scheduler.set_budgets(replace(r.loop.scheduler.policy.policy, max_running=2))  # type: ignore[union-attr]
    r.loop.reset()
    assert isinstance(r.loop.scheduler, GenScheduler)
    assert r.loop.generating.scheduler is r.loop.scheduler
    assert r.loop.scheduler.policy.policy.max_running == 2  # a live change is kept
    assert runner.forgotten == 1 and not runner.running  # the runner starts over too
    for k in range(3):
        submit(r, f"q{k}", max_new_tokens=4, stream=True)
    r.run()
    sink = r.loop.parts.sink
    assert isinstance(sink, MemorySink)
    for k in range(3):
        assert [it.seq for it in sink.streamed[f"q{k}"]] == [1, 2, 3, 4, 5]


class _Crash(Exception):
    pass


def _stuck_rig() -> tuple[Rig, Tokens]:
    # steps of 10 ms, the third stuck in the device for 5 s; the loop crashes at 0.1 s
    steps = iter(range(10_000))
    runner = Tokens(max_running=4)
    r = rig(runner, cost=lambda work: 5.0 if next(steps) == 2 else STEP_S,
            worker={"claim_idle_ms": 400})  # fmt: skip
    submit(r, "long", max_new_tokens=60)

    def crash() -> None:
        raise _Crash("the loop thread fails")

    r.world.at(T0 + 0.1, crash)
    with pytest.raises(_Crash):
        r.run()
    r.source.holding = Holding()  # the intake had not been told the step started
    return r, runner


def test_a_crashed_loop_waits_for_a_step_stuck_in_its_device_before_starting_again() -> None:
    # (worker/app.py: settle, then reset; a new device thread must not run the same model
    # beside the stuck one, nor the runner be emptied under it)
    r, runner = _stuck_rig()
    assert r.device.alive
    seen: dict[float, float | None] = {}
    for t in (0.3, 1.0, 3.0):
        r.world.at(T0 + t, lambda t=t: seen.__setitem__(t, r.loop.hung_for()))
    assert r.loop.settle(poll_s=1.0)
    assert not r.device.alive and r.world.now >= T0 + 5.02
    assert r.loop.hung_for() is None  # the step ended
    # the worker reported the device hung (for /livez) while it waited, with since when
    assert seen[0.3] is None
    assert seen[1.0] is not None and 0.97 <= seen[1.0] <= 0.99
    assert seen[3.0] is not None and 2.97 <= seen[3.0] <= 2.99
    assert runner.forgotten == 0 and runner.running  # not emptied under the stuck step
    while r.loop.parts.inbox.get_nowait() is not None:  # (a real reset has a new inbox
        pass  # and a new intake)
    r.source.restart()
    r.loop.reset()
    assert runner.forgotten == 1 and not runner.running
    assert r.loop.hung_for() is None
    submit(r, "next", max_new_tokens=4)
    r.run()
    sink = r.loop.parts.sink
    assert isinstance(sink, MemorySink)
    res = decode_result(sink.results["next"])
    assert res.status == "ok" and res.usage is not None and res.usage.completion_tokens == 4


def test_a_crashed_loop_stopped_while_its_device_is_stuck_is_not_started_again() -> None:
    r, runner = _stuck_rig()
    r.world.at(T0 + 2.0, r.loop.stop)
    assert not r.loop.settle(poll_s=1.0)
    assert r.device.alive and r.world.now < T0 + 5.0 and runner.forgotten == 0


def test_requests_taken_over_by_another_worker_end_unanswered(ahead: bool) -> None:
    # Given a and b generating, w waiting for a slot, when the intake finds a and w pending
    # on another consumer (the idle fallback gave them away while this worker stalled)
    runner = Tokens(max_running=2, schedule_ahead=ahead)
    r, _ = gen_rig(runner)
    a = r.source.add(Request(id="a", model=MODEL, inputs=["x"], max_new_tokens=60, stream=True))
    b = r.source.add(Request(id="b", model=MODEL, inputs=["x"], max_new_tokens=20, stream=True))
    w = r.source.add(Request(id="w", model=MODEL, inputs=["x"], max_new_tokens=5, stream=True))
    held: list[tuple[str, ...]] = []
    r.world.at(T0 + 0.055, lambda: r.loop.parts.inbox.put(Lost((a, w))))
    r.world.at(T0 + 0.2, lambda: held.append(tuple(e.key for e in r.source.holding.entries)))
    r.run()
    # Then a stops within a step or two, streams nothing more and gets no result, nor its
    # token stream an end; w never starts; b is answered as usual
    assert "a" not in r.sink.results and "w" not in r.sink.results
    assert [k for wk in runner.steps for k, why in wk.stop] == [a.key]
    assert [why for wk in runner.steps for _, why in wk.stop] == [LOST]
    assert all(k != w.key for wk in runner.steps for k, _ in wk.admit)
    streamed = r.sink.streamed["a"]
    assert all(it.delta is not None for it in streamed) and len(streamed) <= 8
    assert "w" not in r.sink.streamed
    assert outputs(r, "b")["completion_tokens"] == 20
    assert held[0] == (b.key,)  # the intake refreshes a and w no more
