"""A generating loop's device failures, end to end (real Redis, the tiny Llama): a step
whose hand-off fails leaves no request running in the engine that the loop failed (they
are stopped with a later step, their rows and KV blocks freed, the scheduler's count the
engine's again), and a stop raised in the device thread mid-generation hands the
requests back to the fleet, unanswered, for another worker to finish. Threads are joined
with a generous guard: a loop that missed a step would hang the test, not pass late."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.client import Job
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.results import Delta
from batchfleet.worker.gen_scheduler import GenScheduler
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.observers import BatchDone, Generated, LoopEvent
from batchfleet.worker.runner import LOST, StepReport, Work
from batchfleet.worker.runners.generation import TextGenerationRunner
from conftest import TINY_LM_OPTIONS
from devices import DEVICE

from batchfleet.config import ModelConfig, WorkerConfig

pytestmark = pytest.mark.timeout(180)

MODEL = "tinylm"
KEYS = ModelKeys(MODEL)
HANG_GUARD_S = 60.0
CLAIM_IDLE_MS = 600_000
"""Long: a request handed back is marked idle this long; one merely left pending is not."""
BREAK_AT = 3
"""The step that fails: every request has generated a token or two by then."""
AHEAD = [True]
"""The runners' ``schedule_ahead`` (each test runs both ways, see ``ahead``)."""


@pytest.fixture(autouse=True, params=[True, False], ids=["ahead", "in-turn"])
def ahead(request: pytest.FixtureRequest) -> Iterator[bool]:
    AHEAD[0] = request.param
    yield request.param
    AHEAD[0] = True


@dataclass(frozen=True, slots=True)
class Held:
    """What the engine held at the end of a step (after its deltas, its progress filled)."""

    step_id: str
    stops: tuple[tuple[str, str], ...]
    sequences: int
    kv_tokens: int
    keys: frozenset[str]


class Breaking(TextGenerationRunner):
    """The tiny Llama whose step ``break_at`` breaks: its hand-off fails (the deferred
    progress fill raises); with ``stop``, the step raises it first; with ``crash``, the
    step raises it once it ran (a runner bug). It notes, at the end of every step, which
    requests' sequences its engine holds (public ``engine.state``)."""

    break_at = BREAK_AT
    stop: BaseException | None = None
    crash: Exception | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0
        self.names: dict[str, str] = {}
        """Every admitted request's sequence (one input, ``n`` 1), by key."""
        self.streaming: set[str] = set()
        """The keys of the streaming ones."""
        self.held: list[Held] = []

    def step(self, work: Work) -> StepReport:
        self.steps += 1
        if self.steps == self.break_at and self.stop is not None:
            raise self.stop
        self.names |= {key: f"{key}#0" for key, _ in work.admit}
        self.streaming |= {key for key, prep in work.admit if prep.payload.stream}
        report = super().step(work)
        if self.steps == self.break_at and self.crash is not None:
            self.held.append(self._holding(work))
            raise self.crash
        fill, breaks = report.deferred, self.steps == self.break_at
        assert fill is not None

        def deferred() -> None:
            if breaks:
                raise RuntimeError("progress lost")
            fill()
            self.held.append(self._holding(work))

        report.deferred = deferred
        return report

    def _holding(self, work: Work) -> Held:
        states = {k: s for k, n in self.names.items() if (s := self.engine.state(n)) is not None}
        return Held(work.step_id, work.stop, len(states),
                    sum(s.context for s in states.values()), frozenset(states))  # fmt: skip


class Seen:
    """The scheduler's count after each step: sequences running, tokens in the KV cache."""

    def __init__(self) -> None:
        self.step_id = ""
        self.after: dict[str, tuple[int, int]] = {}

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, BatchDone):
            self.step_id = event.batch_id
        elif isinstance(event, Generated):
            self.after[self.step_id] = (event.running, event.kv_tokens)


def _runner(tiny_lm: Path, break_at: int = BREAK_AT, **fault: BaseException) -> Breaking:
    """The tiny Llama breaking at step ``break_at`` (0: never), as ``fault`` says."""
    runner = Breaking(tiny_lm, device=DEVICE, dtype="float32", options=TINY_LM_OPTIONS)
    runner.break_at = break_at
    runner.schedule_ahead = AHEAD[0]
    for name, exc in fault.items():
        setattr(runner, name, exc)
    return runner


def _loop(
    r: redis.Redis, runner: Any, consumer: str, *, burst: bool, seen: Seen | None = None
) -> BatchLoop:
    return BatchLoop(MODEL, ModelConfig(path="/unused", max_tokens=64), runner, r,
                     consumer=consumer, burst=burst, observers=[seen] if seen else (),
                     worker=WorkerConfig(block_ms=50, claim_idle_ms=CLAIM_IDLE_MS,
                                         shutdown_grace_s=3600))  # fmt: skip


def _run(loop: BatchLoop) -> None:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the loop hung"
    assert loop.wait_stopped(0)


def _submit(producer: Producer, text: str, new: int, *, stream: bool) -> Job:
    return producer.submit(
        MODEL, text, max_new_tokens=new, stream=stream, ignore_eos=True, priority=0
    )


def test_requests_failed_by_a_broken_hand_off_leave_the_engine_and_the_rest_go_on(
    r: redis.Redis, tiny_lm: Path, ahead: bool
) -> None:
    # Given two streaming generations (each step names them: a delta) and two that do not
    # stream (a step that gives them a token names neither), all read before the loop
    # starts, and a model whose third step's hand-off fails (its progress fill raises)
    producer = Producer(client=r)
    streams = [_submit(producer, f"the dog {k}", 40, stream=True) for k in range(2)]
    quiet = [_submit(producer, f"the fox {k}", 12, stream=False) for k in range(2)]
    runner, seen = _runner(tiny_lm), Seen()
    loop = _loop(r, runner, "w1", burst=True, seen=seen)
    assert isinstance(loop.scheduler, GenScheduler)
    # When a burst loop serves them
    _run(loop)
    # Then the streaming ones failed with the step (the runner's state after it cannot be
    # trusted), their token streams ended; the others got all their tokens
    for job in streams:
        res = job.result(timeout=1)
        assert res.status == "error" and res.error is not None
        assert res.error.code is ErrorCode.INFERENCE_FAILED
        assert "finishing the step failed: RuntimeError: progress lost" in res.error.message
        # (each delta streamed once, the end numbered after them: the step was handed over
        # twice, its deltas written the first time only)
        entries = [fields for _, fields in r.xrange(KEYS.tokens(job.id))]
        assert [int(f[b"seq"]) for f in entries] == list(range(1, len(entries) + 1))
        assert len(entries) > BREAK_AT and entries[-1].get(b"end") == b"1"
    for job in quiet:
        res = job.result(timeout=1)
        assert res.ok and res.usage is not None and res.usage.completion_tokens == 12
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
    # ...from then on the scheduler counts what the engine holds, sequences and KV tokens
    counted = [(seen.after[h.step_id], (h.sequences, h.kv_tokens)) for h in runner.held[stop_at:]]
    assert counted and all(ours == engine for ours, engine in counted)
    assert any(sequences for _, (sequences, _) in counted)  # (the quiet ones ran on)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0


def test_requests_a_crashed_step_admitted_leave_the_engine(
    r: redis.Redis, tiny_lm: Path, ahead: bool
) -> None:
    # Given two generations, and a model whose first step raises once it admitted them
    producer = Producer(client=r)
    jobs = [_submit(producer, f"the dog {k}", 40, stream=k == 0) for k in range(2)]
    runner = _runner(tiny_lm, break_at=1, crash=RuntimeError("runner bug"))
    # When a burst loop serves them
    _run(_loop(r, runner, "w1", burst=True))
    # Then both failed with the runner's error, and the next step stopped them in the
    # engine (which held them when the step raised): it holds nothing when the loop ends
    for job in jobs:
        res = job.result(timeout=1)
        assert res.status == "error" and res.error is not None
        assert "RuntimeError: runner bug" in res.error.message
    crashed, *after = runner.held
    assert crashed.keys == set(runner.names) and len(crashed.keys) == 2
    stopping = next(h for h in after if h.stops)
    assert after.index(stopping) == int(ahead)  # (planned ahead, one was queued already)
    assert sorted(stopping.stops) == sorted((k, LOST) for k in runner.names)
    assert stopping.sequences == 0 and not stopping.keys


@pytest.mark.parametrize("stop", [SystemExit(1), KeyboardInterrupt()], ids=type)
def test_a_stop_raised_mid_generation_hands_the_requests_back_for_another_worker(
    r: redis.Redis, tiny_lm: Path, stop: BaseException
) -> None:
    # Given two streaming generations, and a (non-burst) loop whose third step raises a
    # stop: both have streamed deltas by then
    producer = Producer(client=r)
    jobs = [_submit(producer, f"the dog {k}", 10, stream=True) for k in range(2)]
    # When it runs
    _run(_loop(r, _runner(tiny_lm, stop=stop), "w1", burst=False))
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
    _run(_loop(r, _runner(tiny_lm, break_at=0), "w2", burst=True))
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
