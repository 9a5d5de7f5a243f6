"""The scheduler of one model: its request state, and from state and time, what to do next.

It holds the requests read and not yet dispatched, and the steps dispatched and not yet
finished (the running one, and at most one queued behind it). :meth:`Scheduler.decide`
turns that state and the time into actions — a step to dispatch, requests to expire, when
to decide again — by asking the batching engine; :meth:`Scheduler.finished` takes a
finished step back and teaches the engine its measured time. No threads, no Redis, no
wall clock: the loop thread owns it and passes the time in.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..batching.engine import Engine
from ..batching.types import Batch, Plan
from .answers import Held
from .runner import StepReport, Work
from .streams import Entry

PREQUEUE_S = 0.003
"""Plan and queue the next step when the running one is due to end within this long, so
the device goes from step to step without waiting for the loop."""
SUSPECT = 3
"""Deliveries from which a request runs alone: its last two holders died, and one of them
may have died of it (see ModelStreams.reclaim)."""


def step_ids() -> Callable[[], str]:
    """Unique step ids (they are Flower's task ids too): a random prefix per scheduler and a
    counter. Not a uuid4 per step: ``os.urandom`` gives up the GIL, and while the device
    thread runs a step, taking it back cost the loop thread about 0.2 ms each time."""
    prefix = uuid.uuid4().hex[:8]
    counter = itertools.count(1)
    return lambda: f"{prefix}-{next(counter):x}"


@dataclass(slots=True)
class Step:
    """A dispatched step: a batch of held requests on (or queued for) the device."""

    step_id: str
    batch: Batch
    held: list[Held]
    started_at: float | None
    """When the device began it: the dispatch time when the device was idle, else the end
    of the step before (known once that one finishes)."""
    stop: tuple[tuple[str, str], ...] = ()
    preempt: tuple[str, ...] = ()
    step_tokens: int | None = None
    preempt_seqs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    resume: tuple[tuple[str, tuple[int, ...], int], ...] = ()

    def work(self) -> Work:
        admit = tuple((h.waiting.key, h.prepared) for h in self.held)
        lanes = tuple(h.waiting.lane for h in self.held)
        return Work(self.step_id, admit, self.stop, self.preempt, lanes, self.step_tokens,
                    self.preempt_seqs, self.resume)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do now: dispatch ``step`` (if any), answer ``expired`` and ``refused``,
    decide again by ``wake_at`` (None: when an event comes)."""

    step: Step | None
    expired: list[Held]
    wake_at: float | None
    refused: list[tuple[Held, str]] = field(default_factory=list)
    """Requests that can never run here, with why: answered ``invalid_request``."""


class Scheduler:
    """Request state of one model; the loop thread alone calls it."""

    def __init__(self, engine: Engine, new_id: Callable[[], str] | None = None) -> None:
        self.engine = engine
        self.held: dict[str, Held] = {}
        self.inflight: deque[Step] = deque()
        self._new_id = new_id or step_ids()
        self._running_suspect = False
        self.version = 0
        """Bumped whenever the set of entries held changes (see :meth:`holding`)."""

    # --- state ------------------------------------------------------------------------------

    def admit(self, held: Held) -> None:
        self.held[held.waiting.key] = held
        self.version += 1

    @property
    def busy(self) -> bool:
        """Steps dispatched and not finished."""
        return bool(self.inflight)

    def holding(self) -> tuple[Entry, ...]:
        """The stream entries of every request held: waiting, queued or on the device."""
        held = [*self.held.values(), *(h for step in self.inflight for h in step.held)]
        return tuple(h.entry for h in held)

    @property
    def busy_since(self) -> float | None:
        """When the step on the device began (None: the device is idle)."""
        return self.inflight[0].started_at if self.inflight else None

    def release_all(self) -> list[Held]:
        """Forget every held request (they go back to the fleet)."""
        held = list(self.held.values())
        self.held.clear()
        self.version += 1
        return held

    def cancel(self, step_ids: list[str]) -> list[Held]:
        """Take back dispatched steps that never started; their requests, to hand back."""
        dropped = [s for s in self.inflight if s.step_id in step_ids]
        for step in dropped:
            self.inflight.remove(step)
            if step.batch.reason == "retry":
                self._running_suspect = False
        self.version += 1
        return [h for step in dropped for h in step.held]

    # --- deciding ---------------------------------------------------------------------------

    def decide(self, now: float, *, behind: bool = False, dispatch: bool = True) -> Decision:
        """The actions for ``now``. ``behind``: results are piling up in the sink (a batch
        waits behind another), so hold the next batch (it grows meanwhile). ``dispatch``
        False (stopping): expire, but start nothing new."""
        running = len(self.inflight)
        due = self._due()
        expected = None if not running else max(now, due or now)
        suspect = self._suspect()
        # Queue behind the running step only when it is due to end within PREQUEUE_S. Past
        # its predicted end, when it ends is unknown: wait for it, so the next batch is not
        # formed early from whatever has arrived.
        can_queue = running == 1 and due is not None and abs(due - now) <= PREQUEUE_S
        waiting = [h.waiting for h in self.held.values() if h.entry.deliveries < SUSPECT]
        if behind or not dispatch:
            plan = self.engine.plan(waiting, now, expected or now)
        elif running == 0 and suspect is not None:
            plan = Plan(batch=Batch((suspect.waiting,), "retry"))
        elif running == 0 or (can_queue and suspect is None and not self._running_suspect):
            plan = self.engine.plan(waiting, now, None)
        else:
            plan = self.engine.plan(waiting, now, expected)
        expired = [h for w in plan.expired if (h := self.held.pop(w.key, None)) is not None]
        if expired:
            self.version += 1
        step = self._dispatch(plan.batch, now) if plan.batch is not None else None
        wake_at = plan.wake_at
        if len(self.inflight) == 1 and self.held:
            due = self._due()  # wake in time to queue the next step behind it
            if due is not None and due - PREQUEUE_S > now:
                wake_at = due - PREQUEUE_S if wake_at is None else min(wake_at, due - PREQUEUE_S)
        return Decision(step, expired, wake_at)

    def _dispatch(self, batch: Batch, now: float) -> Step:
        held = [self.held.pop(w.key) for w in batch.items]
        self._running_suspect = batch.reason == "retry"
        step = Step(self._new_id(), batch, held, None if self.inflight else now)
        self.inflight.append(step)
        return step

    def _due(self) -> float | None:
        """When the running step should end by the cost model (None: not known)."""
        if not self.inflight:
            return None
        first = self.inflight[0]
        if first.started_at is None:
            return None
        return first.started_at + self.engine.estimate(first.batch.rows, first.batch.padded_tokens)

    def _suspect(self) -> Held | None:
        return next((h for h in self.held.values() if h.entry.deliveries >= SUSPECT), None)

    @property
    def holds_suspect(self) -> bool:
        """A suspect is held or running: reclaim no other until it is answered."""
        return self._running_suspect or self._suspect() is not None

    # --- learning ---------------------------------------------------------------------------

    def finished(
        self, step_id: str, report: StepReport, started_at: float, finished_at: float
    ) -> Step:
        """Take back a finished step (steps finish in dispatch order) and learn from it."""
        step = self.inflight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"step {step_id} finished, but {step.step_id} was first")
        self.version += 1
        step.started_at = started_at
        if self.inflight:  # the device went straight on to the next one
            self.inflight[0].started_at = finished_at
        if step.batch.reason == "retry":
            self._running_suspect = False
        if report.out_of_memory:
            self.engine.out_of_memory(step.batch, finished_at)
        elif report.calls == 1:
            self.engine.observe(step.batch, finished_at - started_at)
        return step

    def read_budget(self) -> int:
        """How many more requests to read now."""
        return self.engine.read_budget(len(self.held))

    def lane0_reads(self) -> int:
        """Lane-0 requests to read beyond ``read_budget`` (none: a batch window's reads
        already follow the lanes' weights)."""
        return 0
