"""The batch loop in virtual time: the real loop, scheduler and answers, driven by a clock
that jumps, a scripted intake, a scripted device and the in-memory sink. No sleeps, no
timing assertions: every time below is exact virtual time."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from batchfleet.batching.types import Batch, Waiting
from batchfleet.schemas.codec import decode_result
from batchfleet.schemas.errors import ErrorCode
from batchfleet.worker.holding import HAND_OVER_EVERY_S, entries_to_refresh
from batchfleet.worker.observers import BatchDone, Dispatched, Expired, StateChanged
from batchfleet.worker.runner import Final, Partial, Request, StepReport, Work
from batchfleet.worker.scheduler import PREQUEUE_S
from virtual_world import MODEL, T0, Rig, Words, linear_cost, rig


def teach(r: Rig, seconds: float, sizes: Sequence[int] = (1, 2, 4)) -> None:
    """The engine has measured batches of these sizes taking ``seconds`` each."""
    for rows in tuple(sizes) * 3:
        items = tuple(Waiting(key=f"k{i}", lane=0, arrived=0.0, tokens=8) for i in range(rows))
        r.loop.engine.observe(Batch(items, "full"), seconds)


def dispatches(r: Rig) -> list[tuple[float, Dispatched]]:
    return r.recorder.of(Dispatched)


def test_every_request_is_answered_with_exact_timings() -> None:
    r = rig(cost=linear_cost(0.020, 0.001))
    ids = [r.submit(f"the dog number {i}", lane=i % 3) for i in range(40)]
    r.run()
    results = r.results()
    assert set(results) == set(ids) and all(res.ok for res in results.values())
    for res in results.values():
        t = res.timings
        assert t.worker == "v1" and t.batch_id and t.batch_size >= 1
        # total = queued + batch wait + inference, to the microsecond (one virtual clock)
        assert t.total_ms == pytest.approx(t.queued_ms + t.batch_wait_ms + t.inference_ms, abs=1e-3)
        assert t.inference_ms == pytest.approx(20 + t.batch_size, abs=1e-3)
        assert res.outputs == [4]
    # finished_at_ms is on the loop's (Redis) clock, not the worker's wall clock
    assert all(T0 * 1000 <= res.finished_at_ms <= r.world.now * 1000 for res in results.values())


def test_a_fixed_window_holds_a_lone_request_exactly_max_wait() -> None:
    # Given a fixed 50 ms window and one lone request at T0
    r = rig(batch={"max_wait_ms": 50, "adaptive": False})
    rid = r.submit("the dog", at=T0)
    r.run()
    # Then its batch leaves exactly 50 ms after it arrived, not when a read times out
    ((at, _),) = dispatches(r)
    assert at == pytest.approx(T0 + 0.050, abs=1e-9)
    assert r.result(rid).timings.batch_wait_ms == pytest.approx(50.0, abs=1e-3)


def test_an_idle_device_takes_a_lone_request_at_once() -> None:
    r = rig()
    rid = r.submit("the dog", at=T0 + 1)
    r.run()
    ((at, d),) = dispatches(r)
    assert at == T0 + 1 and d.batch.reason in ("idle", "window")
    assert r.result(rid).timings.batch_wait_ms == 0.0


def test_the_next_step_is_queued_just_before_the_running_one_ends_and_no_more() -> None:
    # Given batches of at most 4 that the engine knows take 0.5 s, one request running
    r = rig(batch={"max_batch_size": 4}, cost=lambda work: 0.5)
    teach(r, 0.5)
    r.submit("the first request", at=T0)
    for i in range(10):  # and ten more arriving while it runs
        r.submit(f"request number {i}", at=T0 + 0.1)
    r.run()
    times = [t for t, _ in dispatches(r)]
    spans = r.device.spans
    first_end = spans[0].end
    # Then the second is queued within PREQUEUE_S before the first ends, the third only
    # once the second runs (never two queued), so the device never waits for the loop
    assert [d.batch.rows for _, d in dispatches(r)] == [1, 4, 4, 2]
    assert first_end - PREQUEUE_S <= times[1] < first_end
    assert times[2] >= first_end
    assert all(b.start == a.end for a, b in itertools.pairwise(spans))
    in_flight = [
        sum(1 for d, sp in zip(times, spans, strict=True) if d <= t < sp.end) for t in times
    ]
    assert max(in_flight) == 2


def test_a_step_that_overruns_its_estimate_is_followed_the_moment_it_ends() -> None:
    # Given an engine expecting 1 ms steps, and a first step that takes 0.3 s
    durations = iter([0.3, 0.001, 0.001])
    r = rig(cost=lambda work: next(durations))
    teach(r, 0.001)
    first = r.submit("the first request", at=T0)
    later = [r.submit("second one", at=T0 + 0.05), r.submit("third one", at=T0 + 0.05)]
    r.run()
    # Then the held requests start exactly when the overrunning step ends
    spans = r.device.spans
    assert spans[0].end == pytest.approx(T0 + 0.3)
    assert spans[1].start == pytest.approx(spans[0].end)
    assert {r.result(x).timings.batch_id for x in later} == {spans[1].step_id}
    assert r.result(first).ok


def test_out_of_memory_splits_the_batch_and_lowers_the_caps() -> None:
    # Given a model that runs out of memory above 4 rows, and 96 requests at once
    runner = Words(oom_above=4)
    r = rig(runner)
    ids = [r.submit(f"the dog {i}", lane=0) for i in range(96)]
    r.run()
    results = [r.result(i) for i in ids]
    assert all(res.ok for res in results)
    assert r.loop.stats.oom_events >= 1 and max(runner.runs) <= 4
    sizes = [res.timings.batch_size for res in results]
    assert max(sizes) > 4, "the first batch was larger than the device could take"
    assert sizes[-1] <= 8, "the engine lowered its caps"


def test_a_failing_request_fails_alone_and_its_batch_mates_succeed() -> None:
    r = rig(Words(poison="poison"), batch={"max_wait_ms": 10, "adaptive": False})
    ids = [r.submit(t, at=T0, lane=0) for t in ["the dog", "poison", "the fox", "a day"]]
    r.run()
    statuses = [r.result(i).status for i in ids]
    assert statuses == ["ok", "error", "ok", "ok"]
    assert r.result(ids[1]).error.code is ErrorCode.INFERENCE_FAILED
    ((_, done),) = r.recorder.of(BatchDone)
    assert done.failed == 1 and len(done.request_ids) == 4


def test_a_suspect_runs_alone_and_a_request_past_max_deliveries_is_poisoned() -> None:
    # Given requests redelivered: one twice (its last two holders died), one too often
    r = rig(worker={"max_deliveries": 3})
    fine = [r.submit(f"fine {i}", at=T0) for i in range(5)]
    suspect = r.submit("suspect", at=T0, deliveries=3)
    poison = r.submit("poison", at=T0, deliveries=4)
    r.run()
    # Then the suspect ran in a batch of its own, and the poison was not computed
    by_batch = {r.result(i).timings.batch_id for i in fine}
    assert r.result(suspect).ok and r.result(suspect).timings.batch_size == 1
    assert r.result(suspect).timings.batch_id not in by_batch
    res = r.result(poison)
    assert res.status == "error" and res.error.code is ErrorCode.POISONED
    assert [code for _, code, _ in r.sink.dead] == ["poisoned"]
    assert [d.batch.reason for _, d in dispatches(r)].count("retry") == 1


def test_a_deadline_that_cannot_be_met_is_answered_expired_without_computing() -> None:
    r = rig(cost=lambda work: 0.2)
    teach(r, 0.2)
    running = r.submit("keeps the device busy", at=T0)
    late = r.submit("needs an answer in 50 ms", at=T0 + 0.01, deadline_ms=50)
    fine = r.submit("has a minute", at=T0 + 0.01, deadline_ms=60_000)
    r.run()
    res = r.result(late)
    assert res.status == "expired" and res.error.code is ErrorCode.DEADLINE_EXCEEDED
    assert res.outputs is None and res.timings.batch_id == "" and res.timings.batch_size == 0
    assert r.result(fine).ok and r.result(running).ok
    ((_, ev),) = r.recorder.of(Expired)
    assert ev.request_ids == (late,)
    assert r.loop.stats.rows == 2


def test_bad_entries_are_answered_or_dead_lettered_and_never_stop_the_loop() -> None:
    r = rig()
    good = r.submit("the dog")
    r.source.add_raw({b"msgpack": b"\xc1 not msgpack"})
    r.source.add_raw({b"json": b'{"id": "typo", "model": "tiny", "input": ["x"]}'})
    r.run()
    assert r.result(good).ok
    assert r.result("typo").error.code is ErrorCode.INVALID_REQUEST
    assert [code for _, code, _ in r.sink.dead] == ["malformed"]


def test_pause_stops_reading_but_answers_what_is_held_then_resume_reads_again() -> None:
    r = rig(cost=lambda work: 0.1, burst=False)
    first = [r.submit(f"early {i}", at=T0) for i in range(3)]
    later = [r.submit(f"later {i}", at=T0 + 1.0) for i in range(3)]
    r.world.at(T0 + 0.5, r.loop.pause)
    r.world.at(T0 + 2.0, r.loop.resume)
    r.world.at(T0 + 3.0, r.loop.stop)
    r.run()
    assert all(r.result(i).ok for i in first + later)
    # the later ones arrived at T0+1 while paused: read only after the resume at T0+2
    assert all(r.result(i).timings.queued_ms >= 1000 for i in later)
    grants_while_paused = [c for t, c in r.source.grants if T0 + 0.5 < t < T0 + 2.0 and c]
    assert grants_while_paused == []
    states = [e.state for _, e in r.recorder.of(StateChanged)]
    assert states == ["paused", "running", "stopping"]


def test_drain_answers_what_is_held_and_stops_without_reading_more() -> None:
    r = rig(batch={"max_batch_size": 2}, cost=lambda work: 0.1, burst=False)
    held = [r.submit(f"held {i}", at=T0) for i in range(4)]
    r.world.at(T0 + 0.05, r.loop.drain)
    unread = r.submit("arrives later", at=T0 + 0.06)
    r.run()
    assert all(r.result(i).ok for i in held)
    assert unread not in r.sink.results
    assert r.loop.wait_stopped(0)


def test_stop_finishes_the_running_step_and_hands_back_what_is_held() -> None:
    fixed = {"max_batch_size": 2, "max_wait_ms": 10, "adaptive": False}
    r = rig(batch=fixed, cost=lambda work: 1.0, burst=False)
    teach(r, 1.0, (1, 2))
    ids = [r.submit(f"req {i}", at=T0) for i in range(6)]
    r.world.at(T0 + 0.5, r.loop.stop)
    r.run()
    done = [i for i in ids if i in r.sink.results]
    assert len(done) == 2 and all(r.result(i).ok for i in done)
    assert len(r.source.released) == 4, "the unstarted go back to the fleet"


def test_the_intake_is_told_which_entries_are_held_until_they_are_answered() -> None:
    # Given three requests and steps of one request taking 1 s each
    r = rig(batch={"max_batch_size": 1}, cost=lambda work: 1.0)
    keys = [
        r.source.add(Request(id=f"h{i}", model=MODEL, inputs=["the dog"])).key for i in range(3)
    ]
    seen: dict[float, set[str]] = {}
    for t in (0.5, 1.5, 2.5):
        r.world.at(T0 + t, lambda t=t: seen.__setitem__(t, {e.key for e in r.source.held}))
    r.run()
    # Then each is in the intake's snapshot (to refresh) while waiting or on the device only
    assert seen == {0.5: set(keys), 1.5: set(keys[1:]), 2.5: set(keys[2:])}
    assert r.source.held == ()


def test_a_device_step_running_past_claim_idle_ms_stops_the_refresh_of_what_is_held() -> None:
    # Given a step that hangs (10 s) with the idle fallback at 1 s, and a request behind it
    r = rig(batch={"max_batch_size": 1}, cost=lambda work: 10.0, worker={"claim_idle_ms": 1000})
    first = r.source.add(Request(id="first", model=MODEL, inputs=["the dog"]))
    then = r.source.add(Request(id="then", model=MODEL, inputs=["the dog"]), at=T0 + 0.3)
    refreshed: dict[float, set[str]] = {}

    def look(t: float) -> None:
        entries = entries_to_refresh(r.source.holding, r.world.now, 1000)
        refreshed[t] = {e.key for e in entries}

    for t in (0.5, 0.99, 1.01, 5.0, 10.5):
        r.world.at(T0 + t, lambda t=t: look(t))
    r.run()
    # Then both are refreshed until the step has run 1 s, none after (the idle fallback
    # hands them to other workers); the next step refreshes what is left again
    both = {first.key, then.key}
    assert refreshed == {0.5: both, 0.99: both, 1.01: set(), 5.0: set(), 10.5: {then.key}}


def test_a_change_of_what_is_held_reaches_the_intake_within_the_interval_without_events() -> None:
    # Given a long step, and a request arriving while it runs (then nothing for 0.5 s)
    r = rig(batch={"max_batch_size": 1}, cost=lambda work: 5.0)
    first = r.source.add(Request(id="first", model=MODEL, inputs=["the dog"]))
    then = r.source.add(Request(id="then", model=MODEL, inputs=["the dog"]), at=T0 + 0.02)
    seen: dict[float, set[str]] = {}
    for t in (0.05, 0.15):
        r.world.at(T0 + t, lambda t=t: seen.__setitem__(t, {e.key for e in r.source.held}))
    r.run()
    # Then the intake learns of it within HAND_OVER_EVERY_S: the loop wakes up to tell it
    assert seen == {0.05: {first.key}, 0.15: {first.key, then.key}}


def test_what_is_held_is_handed_over_at_most_every_interval_under_load() -> None:
    # Given 600 requests arriving 1 ms apart, and short steps
    r = rig(batch={"max_batch_size": 8}, cost=linear_cost(0.004, 0.0005))
    for i in range(600):
        r.submit("the dog", at=T0 + i * 0.001)
    r.run()
    # Then the loop made many passes, but handed what it holds over ~10 times a second
    took = r.world.now - T0
    assert len(r.recorder.of(Dispatched)) > 70
    assert len(r.source.handovers) <= took / HAND_OVER_EVERY_S + 3
    assert len(r.results()) == 600 and r.source.held == ()


def test_no_new_batch_leaves_while_results_pile_up_in_the_sink() -> None:
    # Given a sink that stores nothing until flushed
    r = rig(batch={"max_batch_size": 1}, cost=lambda work: 0.01, hold=True, burst=False)
    for i in range(6):
        r.submit(f"req {i}", at=T0)
    r.world.at(T0 + 1.0, r.sink.flush)
    r.world.at(T0 + 2.0, r.loop.stop)
    r.run()
    # Then batches keep leaving while one waits in the sink (the third is queued behind
    # the second), but once two wait, nothing more leaves until the sink catches up at T0+1
    times = [t for t, _ in dispatches(r)]
    assert len([t for t in times if t < T0 + 1.0]) == 3
    assert len(times) == 6 and min(t for t in times[3:]) >= T0 + 1.0
    assert max(len(batch) for batch in r.sink.sent[:1]) == 1


def test_partial_outputs_go_to_the_sink_before_the_final_result() -> None:
    class Streaming(Words):
        def step(self, work: Work) -> StepReport:
            report = super().step(work)
            parts: list[Any] = [
                Partial(key, {"text": "half", "tokens": 1}) for key, _ in work.admit
            ]
            return StepReport(parts + report.events, report.out_of_memory, report.calls)

    r = rig(Streaming())
    rid = r.submit("the dog")
    r.run()
    (sent,) = r.sink.streamed[rid]
    assert sent.seq == 1 and sent.delta is not None and sent.delta.text == "half"
    assert r.result(rid).ok


def test_a_runner_that_forgets_a_request_fails_it_instead_of_leaving_it_waiting() -> None:
    class Forgetful(Words):
        def step(self, work: Work) -> StepReport:
            first_key, first = work.admit[0]
            return StepReport([Final(first_key, [first.rows])])

    r = rig(Forgetful(), batch={"max_batch_size": 2, "max_wait_ms": 50, "adaptive": False})
    a, b = r.submit("one", at=T0), r.submit("two", at=T0)
    r.run()
    results = [r.result(a), r.result(b)]
    assert sorted(res.status for res in results) == ["error", "ok"]


def test_a_prepare_error_is_answered_as_invalid_request() -> None:
    class Picky(Words):
        def prepare_many(self, requests: Sequence[Request]) -> list[Any]:
            from batchfleet.worker.runner import PrepareError

            good = Words.prepare_many(self, requests)
            return [
                PrepareError("no cats here") if "cat" in req.inputs[0] else prep
                for req, prep in zip(requests, good, strict=True)
            ]

    r = rig(Picky())
    ok, bad = r.submit("the dog"), r.submit("the cat")
    r.run()
    assert r.result(ok).ok
    res = r.result(bad)
    assert res.error.code is ErrorCode.INVALID_REQUEST and "no cats" in res.error.message


def test_a_duplicate_request_id_gets_the_first_result_published_again() -> None:
    r = rig(cost=lambda work: 0.01)
    r.submit("the dog", rid="same", at=T0, reply="chan")
    r.submit("the dog", rid="same", at=T0 + 1.0, reply="chan")
    r.run()
    first = r.sink.results["same"]
    assert r.sink.published["chan"] == [first, first]
    assert decode_result(first).ok


def test_prepared_cost_features_reach_the_engine() -> None:
    seen: list[tuple[int, int]] = []

    class Spy(Words):
        def step(self, work: Work) -> StepReport:
            seen.extend((p.rows, p.tokens) for _, p in work.admit)
            return super().step(work)

    r = rig(Spy())
    r.submit(["one two three", "a"], at=T0)
    r.run()
    assert seen == [(2, 3)]
    ((_, d),) = dispatches(r)
    assert d.batch.rows == 2 and d.batch.padded_tokens == 6


def test_a_runner_that_raises_in_prepare_or_miscounts_outputs_fails_only_those_requests() -> None:
    class Broken(Words):
        def prepare_many(self, requests: Sequence[Request]) -> list[Any]:
            if any("crash" in req.inputs[0] for req in requests):
                raise RuntimeError("tokenizer bug")
            return Words.prepare_many(self, requests)

        def step(self, work: Work) -> StepReport:
            return StepReport([Final(key, [1, 2]) for key, _ in work.admit])  # 2 for 1 input

    r = rig(Broken())
    crash = r.submit("crash here", at=T0)
    miscount = r.submit("fine", at=T0 + 1)
    r.run()
    res = r.result(crash)
    assert res.error.code is ErrorCode.INTERNAL and "tokenizer bug" in res.error.message
    res = r.result(miscount)
    assert (
        res.error.code is ErrorCode.INFERENCE_FAILED
        and "2 outputs for 1 inputs" in res.error.message
    )


def test_the_recent_rate_counts_expired_apart_from_errors() -> None:
    from batchfleet.worker.control import RecentRate

    rate = RecentRate()
    r = rig(Words(poison="poison"), cost=lambda work: 0.2)
    r.loop.observers.observers.append(rate)
    teach(r, 0.2)
    r.submit("keeps the device busy", at=T0)
    r.submit("poison", at=T0 + 0.3)
    r.submit("late", at=T0 + 0.01, deadline_ms=50)
    r.submit("fine", at=T0 + 0.01)
    r.run()
    snap = rate.snapshot()
    assert (snap["error_ratio"], snap["expired_ratio"]) == (0.25, 0.25)
    assert "tokens_per_s" not in snap  # not a generating model


def test_stop_hands_back_held_and_queued_requests_at_once() -> None:
    # Given 20 s steps of 2, one running and one queued behind it, and more held
    fixed = {"max_batch_size": 2, "max_wait_ms": 10, "adaptive": False}
    r = rig(batch=fixed, cost=lambda work: 20.0, burst=False)
    ids = [r.submit(f"req {i}", at=T0) for i in range(6)]
    released_at: list[float] = []
    release = r.source.release
    r.source.release = lambda entries: (released_at.append(r.world.now), release(entries))  # type: ignore[method-assign,func-returns-value]
    r.world.at(T0 + 19.999, r.loop.stop)  # the second step is queued by now
    r.run()
    # Then the 4 not on the device went back when the stop came, not after 40 s
    assert released_at[0] == pytest.approx(T0 + 19.999) and len(r.source.released) == 4
    assert [i for i in ids if i in r.sink.results] == ids[:2]


def test_a_runner_returning_something_else_than_a_list_fails_the_request() -> None:
    class Odd(Words):
        def step(self, work: Work) -> StepReport:
            return StepReport([Final(key, None) for key, _ in work.admit])  # type: ignore[arg-type]

    r = rig(Odd())
    rid = r.submit("the dog")
    r.run()
    res = r.result(rid)
    assert res.error.code is ErrorCode.INFERENCE_FAILED and "NoneType outputs" in res.error.message


def test_an_entry_over_max_entry_bytes_with_a_readable_id_is_answered_too_large() -> None:
    import msgpack

    r = rig(limits={"max_entry_bytes": 1024})
    big = {"id": "big-1", "model": "tiny", "reply": "chan", "inputs": ["word " * 400]}
    r.source.add_raw({b"msgpack": msgpack.packb(big)})
    r.source.add_raw({b"msgpack": b"\x81" + b"\xc1" * 2000})  # over the limit, no id to read
    r.run()
    res = r.result("big-1")
    assert res.status == "error" and res.error.code is ErrorCode.TOO_LARGE
    assert r.sink.published["chan"] == [r.sink.results["big-1"]], "its waiting client is told"
    assert [code for _, code, _ in r.sink.dead] == ["too_large"], "only the unreadable one"
