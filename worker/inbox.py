"""The loop's inbox: how the intake, executor, sink and control threads reach the one
thread that owns a model's request state. Each sends an event; only the loop acts on it."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..batching.gen_types import GenPolicy
from ..batching.types import Policy
from .runner import StepReport
from .streams import Entry, Retiring


@dataclass(frozen=True, slots=True)
class Arrived:
    """The intake read these entries at ``read_at`` (loop clock)."""

    entries: Sequence[Entry]
    read_at: float
    cancelled: tuple[str, ...] = ()
    """Ids among them whose clients cancelled them before they were read (generation)."""


@dataclass(frozen=True, slots=True)
class Retire:
    """Redelivered entries whose request has a stored result: not to be computed again."""

    items: Sequence[Retiring]


@dataclass(frozen=True, slots=True)
class ReadIdle:
    """A blocking read returned nothing: the streams were empty (burst mode stops on it)."""


IDLE_REPORTS = 2
"""Empty reads in a row told to the loop (:class:`ReadIdle`) while it holds
requests; past them, only while it holds none. A burst loop stops after two in a row once
it holds nothing; a saturated one, holding a full hold and granting its lane-0 reserve,
would otherwise wake for every ``intake.LANE0_ONLY_BLOCK_MS`` read to plan again for nothing
(``bench.loop_cpu``: 1.5 such reads a step, 40% of the loop's passes)."""


@dataclass(frozen=True, slots=True)
class StepDone:
    """The executor finished a step; times are the loop clock, measured on the device thread."""

    step_id: str
    report: StepReport
    started_at: float
    finished_at: float


@dataclass(frozen=True, slots=True)
class DeviceStopped:
    """The device thread ended on a ``SystemExit``/``KeyboardInterrupt`` in step ``step_id``
    (it never finished): the loop stops, and hands that step's requests back."""

    step_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Wake:
    """Something the loop reads changed (a batch was stored, a flag was set): decide again."""


@dataclass(frozen=True, slots=True)
class SetPolicy:
    """A live policy change: a batch policy, or a generating model's budgets."""

    policy: Policy | GenPolicy


@dataclass(frozen=True, slots=True)
class Cancel:
    """Clients asked to cancel these requests (by id)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Lost:
    """Held entries now pending on another consumer: the idle fallback gave them to another
    worker (this one was unreachable or stalled past ``claim_idle_ms``); not this loop's to
    answer any more."""

    entries: Sequence[Entry]


Event = Arrived | Retire | ReadIdle | StepDone | DeviceStopped | Wake | SetPolicy | Cancel | Lost


class Inbox(Protocol):
    def put(self, event: Event) -> None: ...

    def get(self, timeout: float | None) -> Event | None:
        """The next event, waiting up to ``timeout`` seconds (None: until one comes)."""
        ...

    def get_nowait(self) -> Event | None: ...


class ThreadInbox:
    """The real inbox: a thread-safe FIFO."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        self._q.put(event)

    def get(self, timeout: float | None) -> Event | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_nowait(self) -> Event | None:
        try:
            return self._q.get_nowait()
        except queue.Empty:
            return None
