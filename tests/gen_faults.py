"""A generating loop with faults put in (real Redis, the tiny Llama), for the device
failure tests (``test_gen_device_failures.py``, ``test_gen_handoff_failures.py``): a runner
whose step ``break_at`` breaks as told and that notes, after each step, what its engine
holds; an observer that notes what the scheduler counts; the loop, run to its end."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import redis
from batchfleet.producer import Producer
from batchfleet.producer.client import Job
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Request
from batchfleet.worker.gen_scheduler import GenScheduler
from batchfleet.worker.generation.paged import PagedEngine
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.observers import BatchDone, Generated, LoopEvent
from batchfleet.worker.runner import Partial, Prepared, StepEvent, StepReport, Work
from batchfleet.worker.runners.generation import TextGenerationRunner
from conftest import TINY_LM_OPTIONS
from devices import DEVICE

from batchfleet.config import ModelConfig, WorkerConfig

MODEL = "tinylm"
KEYS = ModelKeys(MODEL)
HANG_GUARD_S = 60.0
CLAIM_IDLE_MS = 600_000
"""Long: a request handed back is marked idle this long; one merely left pending is not."""
BREAK_AT = 3
"""The step that fails: every request has generated a token or two by then."""
ENGINES = ["padded", "paged"]


@dataclass(frozen=True, slots=True)
class Held:
    """What the engine held at the end of a step (after its deltas, its progress filled)."""

    step_id: str
    stops: tuple[tuple[str, str], ...]
    sequences: int
    kv_tokens: int
    keys: frozenset[str]
    contexts: dict[str, int]
    """Each held request's sequence's context (tokens in the KV cache)."""
    blocks: frozenset[str] | None
    """The paged engine: the sequences its KV cache holds blocks for (its own
    accounting, the allocators' block tables); None: the padded engine."""


class Breaking(TextGenerationRunner):
    """The tiny Llama whose step ``break_at`` breaks: its hand-off fails (the deferred
    progress fill raises); with ``stop``, the step raises it first; with ``crash``, the
    step raises it once it ran (a runner bug; ``early``: before it runs), and with ``cure``
    so does every step after it until one admits a prompt holding ``cure``; with ``poison``
    instead, only a step that admits a prompt holding ``poison`` raises ``crash``, before
    it runs.
    It notes, at the end of every step, which requests' sequences its engine holds
    (public ``engine.state``), and the tokens each step gave (``produced``)."""

    break_at = BREAK_AT
    stop: BaseException | None = None
    crash: Exception | None = None
    cure: str | None = None
    early = False
    poison: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0
        self.names: dict[str, str] = {}
        """Every admitted request's sequence (one input, ``n`` 1), by key."""
        self.streaming: set[str] = set()
        """The keys of the streaming ones."""
        self.held: list[Held] = []
        self.produced = 0
        """Tokens generated, every step's."""
        self.crashed: list[str] = []
        """The steps that raised ``crash``."""

    def _admits(self, work: Work, text: str) -> bool:
        """Whether ``work`` admits a prompt holding ``text``."""
        return any(text in self.tokenizer.decode(prep.payload.prompts[0]) for _, prep in work.admit)

    def _crashes(self) -> bool:
        """Whether this step raises ``crash`` once it ran."""
        if self.crash is None or self.poison is not None or not 0 < self.break_at <= self.steps:
            return False
        return self.steps == self.break_at or self.cure is not None

    def step(self, work: Work) -> StepReport:
        self.steps += 1
        if self.steps == self.break_at and self.stop is not None:
            raise self.stop
        if self.cure is not None and self._admits(work, self.cure):
            self.crash = None
        poisoned = self.poison is not None and self._admits(work, self.poison)
        if self.crash is not None and (poisoned or (self.early and self._crashes())):
            self.crashed.append(work.step_id)
            raise self.crash
        self.names |= {key: f"{key}#0" for key, _ in work.admit}
        self.streaming |= {key for key, prep in work.admit if prep.payload.stream}
        report = super().step(work)
        self.produced += sum((report.produced or {}).values())
        if not self.early and self._crashes():
            self.held.append(self._holding(work))
            self.crashed.append(work.step_id)
            assert self.crash is not None
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
        blocks = None
        if isinstance(self.engine, PagedEngine):
            allocators = self.engine.processor.cache.cache_allocators.values()
            blocks = frozenset(
                name for a in allocators for name, ids in a.block_table.items() if ids
            )
        return Held(work.step_id, work.stop, len(states), sum(s.context for s in states.values()),
                    frozenset(states), {k: s.context for k, s in states.items()},
                    blocks)  # fmt: skip


B = TypeVar("B", bound=Breaking)


class Seen:
    """The scheduler's count after each step: sequences running, tokens in the KV cache,
    and each running request's context; and the tokens the loop counted."""

    def __init__(self, scheduler: GenScheduler | None = None) -> None:
        self.scheduler = scheduler
        self.step_id = ""
        self.after: dict[str, tuple[int, int]] = {}
        self.contexts: dict[str, dict[str, int]] = {}
        self.tokens = 0

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, BatchDone):
            self.step_id = event.batch_id
        elif isinstance(event, Generated):
            self.after[self.step_id] = (event.running, event.kv_tokens)
            self.tokens += event.tokens
            if self.scheduler is not None:  # (the loop thread: the scheduler's own)
                self.contexts[self.step_id] = {
                    k: sum(r.progress.contexts) for k, r in self.scheduler.running.items()
                }


def make_runner(
    tiny_lm: Path, *, ahead: bool, engine: str = "padded", break_at: int = BREAK_AT,
    kind: type[B] = Breaking, **fault: BaseException,
) -> B:  # fmt: skip
    """The tiny Llama on ``engine`` (a ``kind`` of :class:`Breaking`), breaking at step
    ``break_at`` (0: never), as ``fault`` says; ``ahead``: its ``schedule_ahead``."""
    options = {**TINY_LM_OPTIONS, "engine": engine}
    runner = kind(tiny_lm, device=DEVICE, dtype="float32", options=options)
    runner.break_at = break_at
    runner.schedule_ahead = ahead
    for name, exc in fault.items():
        setattr(runner, name, exc)
    return runner


def make_loop(
    r: redis.Redis, runner: Any, consumer: str, *, burst: bool, seen: Seen | None = None,
    more: Sequence[Any] = (),
) -> BatchLoop:  # fmt: skip
    """A loop of ``runner``, observed by ``seen`` and ``more``."""
    loop = BatchLoop(MODEL, ModelConfig(path="/unused", max_tokens=64), runner, r,
                     consumer=consumer, burst=burst,
                     observers=[*([seen] if seen else []), *more],
                     worker=WorkerConfig(block_ms=50, claim_idle_ms=CLAIM_IDLE_MS,
                                         shutdown_grace_s=3600))  # fmt: skip
    if seen is not None:
        assert isinstance(loop.scheduler, GenScheduler)
        seen.scheduler = loop.scheduler
    return loop


def run_loop(loop: BatchLoop) -> None:
    """Run ``loop`` to its end (burst, or stopped by itself), with a guard against a hang."""
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the loop hung"
    assert loop.wait_stopped(0)


def submit(producer: Producer, text: str, new: int, *, stream: bool) -> Job:
    return producer.submit(
        MODEL, text, max_new_tokens=new, stream=stream, ignore_eos=True, priority=0
    )


def prepared(runner: TextGenerationRunner, rid: str, **kw: Any) -> Prepared:
    """A request ``rid`` for ``runner`` (prompt "the dog", or ``inputs``), prepared."""
    kw.setdefault("inputs", ["the dog"])
    (prep,) = runner.prepare_many([Request(id=rid, model=MODEL, **kw)])
    assert isinstance(prep, Prepared)
    return prep


def compiling(prep: Prepared) -> tuple[Prepared, Future[Any]]:
    """``prep`` admitted while its constraint compiles: the future that gives it (its
    result or exception decides when, and how, it starts)."""
    fut: Future[Any] = Future()
    return replace(prep, payload=replace(prep.payload, compiling=fut)), fut


def ends(reports: list[StepReport]) -> dict[str, list[StepEvent]]:
    """Each request's events but its deltas, by key, over ``reports``."""
    out: dict[str, list[StepEvent]] = {}
    for report in reports:
        for ev in report.events:
            if not isinstance(ev, Partial):
                out.setdefault(ev.key, []).append(ev)
    return out
