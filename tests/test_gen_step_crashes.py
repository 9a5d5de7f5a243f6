"""A generating loop whose runner's steps raise (real Redis, the tiny Llama, both engines,
both scheduling modes; ``worker/crashes.py``): steps raising over and over fail every
request once, within two crashed steps, free the engine, and the loop serves the next
request once the runner works again; one poisonous prompt fails alone; a request the
runner ended in a step that raised (its event lost) fails, not left waiting. Threads are
joined with a generous guard: a request left running would hang the test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.client import Job
from batchfleet.schemas.keys import GROUP
from batchfleet.worker.crashes import RUNNER_BROKEN_AFTER
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.observers import BatchDone, LoopEvent
from gen_checks import failed_with, stream_entries, whole
from gen_faults import BREAK_AT, ENGINES, KEYS, Held, Seen, make_loop, make_runner, run_loop
from gen_faults import submit as submit_job

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=[True, False], ids=["ahead", "in-turn"])
def ahead(request: pytest.FixtureRequest) -> bool:
    """The runners' ``schedule_ahead``: each test runs both ways."""
    return bool(request.param)


class Failures:
    """Notes the requests each step answered failed, and submits one more request (from
    the loop thread) once ``when`` holds after a step."""

    def __init__(self, when: Callable[[Failures], bool], then: Callable[[], Job]) -> None:
        self.when = when
        self.then = then
        self.loop: BatchLoop | None = None
        self.broken: dict[str, int | None] = {}
        """What the loop's ``broken`` said after each step."""
        self.order: list[str] = []
        """The steps, in the order they ended."""
        self.failed: dict[str, int] = {}
        """Failed answers, by step."""
        self.later: Job | None = None

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, BatchDone):
            self.order.append(event.batch_id)
            assert self.loop is not None
            self.broken[event.batch_id] = self.loop.broken()
            if event.failed:
                self.failed[event.batch_id] = event.failed
            if self.later is None and self.when(self):
                self.later = self.then()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("early", [False, True], ids=["once-run", "before-running"])
def test_a_runner_crashing_every_step_fails_each_request_once_then_serves_again(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str, early: bool
) -> None:
    # Given two streaming generations and two that do not stream, read before the loop
    # starts, and a runner whose every step from the third raises once it ran (``early``:
    # before it runs: the stops it carries never applied), until one admits a prompt
    # holding "cure"; that one is submitted once all four have failed
    producer = Producer(client=r)
    streams = [submit_job(producer, f"the dog {k}", 40, stream=True) for k in range(2)]
    quiet = [submit_job(producer, f"the fox {k}", 40, stream=False) for k in range(2)]
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, crash=RuntimeError("runner bug"))
    runner.cure, runner.early = "cure", early
    seen = Seen()
    failures = Failures(lambda f: sum(f.failed.values()) >= 4,
                        lambda: submit_job(producer, "the cure", 8, stream=True))  # fmt: skip
    # When a burst loop serves them
    failures.loop = loop = make_loop(r, runner, "w1", burst=True, seen=seen, more=[failures])
    run_loop(loop)
    # Then each of the four failed once, all with the second step in a row that raised
    # (the runner taken for broken), their token streams ended once
    for job in streams + quiet:
        failed_with(job, f"crashed in {RUNNER_BROKEN_AFTER} steps in a row")
    for job in streams:
        assert len(stream_entries(r, job)) > BREAK_AT - 1
    assert failures.failed == {runner.crashed[RUNNER_BROKEN_AFTER - 1]: 4}
    assert runner.crashed[0] == failures.order[BREAK_AT - 1]
    # ...the worker's health probes failing from then (the runner broken) until a step ran
    broken = failures.broken[runner.crashed[RUNNER_BROKEN_AFTER - 1]]
    assert broken is not None and broken >= RUNNER_BROKEN_AFTER
    assert failures.broken[failures.order[0]] is None and loop.broken() is None
    # ...a few steps raised before the cure came (the stops of the failed ones, and, ahead,
    # the one queued), none after it
    assert RUNNER_BROKEN_AFTER <= len(runner.crashed) <= RUNNER_BROKEN_AFTER + 1 + ahead
    # ...the engine was emptied: from the cure's first step on it holds only the cure, its
    # KV blocks only the cure's (paged), as the scheduler counts
    assert failures.later is not None
    whole(failures.later, 8, stream=True)
    stream_entries(r, failures.later)
    after = _after(runner.held, failures.order, runner.crashed[-1])
    cure = set(list(runner.names)[-1:])  # (admitted last)
    assert len(runner.names) == 5 and after and after[0].keys == cure
    assert all(h.keys <= cure for h in after)
    assert all(h.blocks is None or h.blocks <= {runner.names[k] for k in cure} for h in after)
    assert all(seen.after[h.step_id] == (h.sequences, h.kv_tokens) for h in after)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_poisonous_prompt_fails_alone_and_the_running_requests_finish(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str
) -> None:
    # Given two streaming generations and one that does not stream, running, and a runner
    # whose step raises (before it runs) whenever it admits a prompt holding "poison":
    # such a prompt comes after their second step
    producer = Producer(client=r)
    streams = [submit_job(producer, f"the dog {k}", 30, stream=True) for k in range(2)]
    quiet = submit_job(producer, "the fox", 30, stream=False)
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=0,
                         crash=RuntimeError("poisoned"))  # fmt: skip
    runner.poison = "poison"
    seen = Seen()
    failures = Failures(lambda f: len(f.order) == 2,
                        lambda: submit_job(producer, "the poison", 8, stream=True))  # fmt: skip
    # When a burst loop serves them
    failures.loop = loop = make_loop(r, runner, "w1", burst=True, seen=seen, more=[failures])
    run_loop(loop)
    # Then the poisonous one failed alone, with the step that admitted it, its stream ended
    assert failures.later is not None and len(runner.crashed) == 1
    failed_with(failures.later, "RuntimeError: poisoned")
    stream_entries(r, failures.later)
    assert failures.failed == {runner.crashed[0]: 1}
    assert set(failures.broken.values()) == {None}  # (one crash: not broken)
    # ...and the others ran to their end, every token and delta of theirs there
    for job in streams:
        whole(job, 30, stream=True)
        stream_entries(r, job)
    whole(quiet, 30)
    # ...the engine never held the poisonous one, and held as the scheduler counts
    assert all(len(h.keys) <= 3 for h in runner.held)
    # (from the crashed one on: ahead, one planned with it counts it running beforehand)
    after = _after(runner.held, failures.order, runner.crashed[0])
    assert after and all(seen.after[h.step_id] == (h.sequences, h.kv_tokens) for h in after)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_ended_in_a_step_that_raised_fails_with_the_next_step(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str
) -> None:
    # Given a short generation (it ends in the second step) beside a longer one, and a
    # runner whose second step raises once it ran: the short one's end is lost with it
    producer = Producer(client=r)
    short = submit_job(producer, "the fox", 2, stream=False)
    long = submit_job(producer, "the dog", 20, stream=False)
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=2,
                         crash=RuntimeError("runner bug"))  # fmt: skip
    seen = Seen()
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True, seen=seen))
    # Then the step after it (it raised no more) failed the short one, which its runner no
    # longer held, instead of leaving it waiting; the long one ran to its end
    crashed = runner.held[1]
    assert runner.crashed == [crashed.step_id] and len(crashed.keys) == 1  # (the long one)
    failed_with(short, "generation lost: a step before this one crashed")
    whole(long, 20)
    after = runner.held[2:]
    assert after and all(seen.after[h.step_id] == (h.sequences, h.kv_tokens) for h in after)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def _after(held: list[Held], order: list[str], step_id: str) -> list[Held]:
    """What the engine held after each step that ended after step ``step_id``."""
    return [h for h in held if order.index(h.step_id) > order.index(step_id)]
