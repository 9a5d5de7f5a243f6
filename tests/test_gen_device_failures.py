"""A generating loop's device failures, end to end (real Redis, the tiny Llama on either
engine, ``padded`` and ``paged``, where its KV blocks are checked freed too): a step
whose hand-off fails leaves no request running in the engine that the loop failed (they
are stopped with a later step, their rows and KV blocks freed, the scheduler's count the
engine's again), and a stop raised in the device thread mid-generation hands the
requests back to the fleet, unanswered, for another worker to finish. Threads are joined
with a generous guard: a loop that missed a step would hang the test, not pass late."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.keys import GROUP
from batchfleet.schemas.results import Delta
from batchfleet.worker.runner import LOST
from gen_checks import failed_with, stream_entries, whole
from gen_faults import (
    BREAK_AT,
    CLAIM_IDLE_MS,
    ENGINES,
    KEYS,
    Held,
    Seen,
    make_loop,
    make_runner,
    run_loop,
    submit,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=[True, False], ids=["ahead", "in-turn"])
def ahead(request: pytest.FixtureRequest) -> bool:
    """The runners' ``schedule_ahead``: each test runs both ways."""
    return bool(request.param)


def _blocked(held: list[Held], names: list[str]) -> list[bool]:
    """Per step, whether the paged engine's own accounting still held KV blocks for any of
    ``names`` (the padded engine has no blocks, none listed: its ``state`` says it all)."""
    return [bool(h.blocks & set(names)) for h in held if h.blocks is not None]


@pytest.mark.parametrize("engine", ENGINES)
def test_requests_failed_by_a_broken_hand_off_leave_the_engine_and_the_rest_go_on(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str
) -> None:
    # Given two streaming generations (each step names them: a delta) and two that do not
    # stream (a step that gives them a token names neither), all read before the loop
    # starts, and a model whose third step's hand-off fails (its progress fill raises)
    producer = Producer(client=r)
    streams = [submit(producer, f"the dog {k}", 40, stream=True) for k in range(2)]
    quiet = [submit(producer, f"the fox {k}", 12, stream=False) for k in range(2)]
    runner, seen = make_runner(tiny_lm, ahead=ahead, engine=engine), Seen()
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True, seen=seen))
    # Then the streaming ones failed with the step (the runner's state after it cannot be
    # trusted), their token streams ended; the others got all their tokens
    for job in streams:
        failed_with(job, "finishing the step failed: RuntimeError: progress lost")
        # (each delta streamed once, the end numbered after them: the step was handed over
        # twice, its deltas written the first time only)
        assert len(stream_entries(r, job)) > BREAK_AT
    for job in quiet:
        whole(job, 12)
    # ...and the failed ones left the engine with a step that stopped them, unanswered,
    # the first planned once the failure was in (planned ahead, one was queued already)
    failed = runner.streaming
    assert len(failed) == 2 and len(runner.names) == 4
    stop_at = next(i for i, h in enumerate(runner.held) if h.stops)
    stopping = runner.held[stop_at]
    assert sorted(stopping.stops) == sorted((k, LOST) for k in failed)
    # (held[BREAK_AT - 1] is the step after the failed one: planned ahead, queued already)
    assert stop_at == BREAK_AT - 1 + ahead
    assert [h.stops for h in runner.held].count(stopping.stops) == 1  # stopped once
    assert all(not (h.keys & failed) for h in runner.held[stop_at:])
    assert all(h.keys & failed for h in runner.held[BREAK_AT - 1 : stop_at])
    failed_names = [runner.names[k] for k in failed]  # (the paged engine: their KV blocks)
    assert all((h.blocks is not None) == (engine == "paged") for h in runner.held)
    assert not any(_blocked(runner.held[stop_at:], failed_names))
    assert all(_blocked(runner.held[BREAK_AT - 1 : stop_at], failed_names))
    # ...from then on the scheduler counts what the engine holds, sequences and KV tokens
    counted = [(seen.after[h.step_id], (h.sequences, h.kv_tokens)) for h in runner.held[stop_at:]]
    assert counted and all(ours == engine for ours, engine in counted)
    assert any(sequences for _, (sequences, _) in counted)  # (the quiet ones ran on)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0
    # ...and the quiet ones, not failed, are where the engine has them at every report
    # after their step's (the failed one's left their progress, the next one gave it whole),
    # and the tokens the failed step gave count (the loop's vLLM generation-token counter)
    mine = set(runner.names) - failed
    for h in runner.held:
        ours = seen.contexts[h.step_id]
        assert {k: ours[k] for k in mine & ours.keys()} == {k: h.contexts[k] for k in mine & h.keys}
    assert seen.tokens == runner.produced


@pytest.mark.parametrize("engine", ENGINES)
def test_requests_a_crashed_step_admitted_leave_the_engine(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str
) -> None:
    # Given two generations, and a model whose first step raises once it admitted them
    producer = Producer(client=r)
    jobs = [submit(producer, f"the dog {k}", 40, stream=k == 0) for k in range(2)]
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=1,
                         crash=RuntimeError("runner bug"))  # fmt: skip
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True))
    # Then both failed with the runner's error, and the next step stopped them in the
    # engine (which held them when the step raised): it holds nothing when the loop ends
    for job in jobs:
        failed_with(job, "RuntimeError: runner bug")
    crashed, *after = runner.held
    assert crashed.keys == set(runner.names) and len(crashed.keys) == 2
    stopping = next(h for h in after if h.stops)
    assert after.index(stopping) == int(ahead)  # (planned ahead, one was queued already)
    assert sorted(stopping.stops) == sorted((k, LOST) for k in runner.names)
    assert stopping.sequences == 0 and not stopping.keys
    names = list(runner.names.values())  # (the paged engine: their KV blocks)
    assert _blocked([crashed, stopping], names) == ([True, False] if engine == "paged" else [])


@pytest.mark.parametrize("stop", [SystemExit(1), KeyboardInterrupt()], ids=type)
def test_a_stop_raised_mid_generation_hands_the_requests_back_for_another_worker(
    r: redis.Redis, tiny_lm: Path, stop: BaseException, ahead: bool
) -> None:
    # Given two streaming generations, and a (non-burst) loop whose third step raises a
    # stop: both have streamed deltas by then
    producer = Producer(client=r)
    jobs = [submit(producer, f"the dog {k}", 10, stream=True) for k in range(2)]
    # When it runs
    run_loop(make_loop(r, make_runner(tiny_lm, ahead=ahead, stop=stop), "w1", burst=False))
    # Then it stopped by itself, unanswered, the requests handed back (marked idle for the
    # next reclaim), their token streams not ended (no error reaches the client)
    for job in jobs:
        assert r.get(KEYS.result(job.id)) is None
        entries = r.xrange(KEYS.tokens(job.id))
        assert entries and all(b"end" not in fields for _, fields in entries)
    pending = r.xpending_range(KEYS.lane(0), GROUP, "-", "+", 10)
    assert len(pending) == 2 and all(p["time_since_delivered"] >= CLAIM_IDLE_MS for p in pending)
    # ...so the next worker generates them again, whole (once the first's reclaim lock,
    # 2 s, is gone): a client reading the deltas sees the restart, then all the tokens
    r.delete(KEYS.reclaim_lock)
    run_loop(make_loop(r, make_runner(tiny_lm, ahead=ahead, break_at=0), "w2", burst=True))
    for job in jobs:
        res = job.result(timeout=1)
        assert res.ok and res.usage is not None and res.usage.completion_tokens == 10
        assert res.outputs is not None
        before, after = _attempts(job.deltas(timeout=5))
        assert before and sum(d.tokens for d in after) == 10
        assert "".join(d.text for d in after) == res.outputs[0]["text"]
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def _attempts(deltas: Iterator[Delta | Restarted]) -> tuple[list[Delta], list[Delta]]:
    """A token stream's deltas before and after its (one) restart."""
    parts: list[list[Delta]] = [[]]
    for d in deltas:
        if isinstance(d, Restarted):
            parts.append([])
        else:
            parts[-1].append(d)
    assert len(parts) == 2, "one restart"
    return parts[0], parts[1]
