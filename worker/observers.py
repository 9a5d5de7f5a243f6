"""What the batch loop tells the world as work moves through it: one event object per hook.

Metrics, Flower task events, stats and webhook deliveries plug in here as observers, so
the loop itself stays one concept. ``Dispatched``, ``BatchDone`` and ``Expired`` are sent
from the model's loop thread; ``Answered`` and ``DeadLettered`` from its sink's writer
thread once written; ``StateChanged`` from whichever thread paused, resumed, drained or
stopped the loop (Celery's remote control). An observer's state must therefore be
thread-safe. Keep ``notify`` cheap and never block on the network (hand slow
work to a queue or another thread). An observer that raises is logged and ignored:
observers can never break inference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..batching.types import Batch
from ..schemas.messages import Request, Result

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reply:
    """A result the sink has just written (``stored`` False: one existed already)."""

    lane: int
    request: Request | None
    """None when the entry could not be decoded into a request."""
    result: Result
    stored: bool


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A micro-batch was handed to the device."""

    model: str
    batch: Batch
    batch_id: str
    request_ids: tuple[str, ...]
    at: float


@dataclass(frozen=True, slots=True)
class BatchDone:
    """A micro-batch finished on the device (``failed`` of its requests got an error)."""

    model: str
    batch: Batch
    batch_id: str
    request_ids: tuple[str, ...]
    seconds: float
    out_of_memory: bool
    failed: int


@dataclass(frozen=True, slots=True)
class Expired:
    """Requests answered ``expired`` in one planning round (never computed)."""

    model: str
    request_ids: tuple[str, ...]
    lanes: tuple[int, ...]
    at: float


@dataclass(frozen=True, slots=True)
class Answered:
    """Results were stored (and published) for these requests."""

    model: str
    replies: Sequence[Reply]


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """An entry went to the dead-letter stream (unreadable, or poison)."""

    model: str
    lane: int
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class StateChanged:
    """The loop was paused, resumed, or began draining or stopping."""

    model: str
    state: str


@dataclass(frozen=True, slots=True)
class Generated:
    """A generating model's state after a step."""

    model: str
    running: int
    """Sequences admitted: in the KV cache, or waiting for their constraints to compile
    (``deferred``)."""
    waiting: int
    """Requests read and not running (new or preempted)."""
    kv_tokens: int
    """Tokens the running sequences hold in the KV cache."""
    kv_capacity: int
    preempted: int
    """Sequences preempted by this step (a request's ``n`` completions each count, as
    vLLM counts its child requests)."""
    waiting_sequences: int | None = None
    """The ``waiting`` requests' sequences (each of a request's ``n`` completions one of vLLM's requests; a
    preempted one's unfinished ones); None: one per request."""
    tokens: int = 0
    """Tokens the step generated."""
    gaps: tuple[tuple[int, float], ...] = ()
    """Inter-token latency: (lane, seconds since the request's previous tokens) for each
    request the step gave tokens that had some before."""
    compiling: int = 0
    """Requests waiting for their constraints to compile."""
    deferred: int = 0
    """Their sequences (counted in ``running``; vLLM counts them as waiting,
    ``deferred``)."""
    admitting: int = 0
    """Sequences admitted by the steps after this one, planned or on the device already
    (counted in ``running``; vLLM's scheduler has them waiting until a step runs them)."""
    compiled_s: tuple[float, ...] = ()
    """How long each constraint compiled since the last step took."""
    drafted: tuple[int, int] = (0, 0)
    """Speculative decoding: rows that proposed drafts, and the drafts proposed."""
    accepted: tuple[int, ...] = ()
    """Speculative decoding: per draft position, the drafts accepted."""
    spec_skipped: int = 0
    """Speculative decoding: rows that proposed nothing because the step's batch size
    turned speculation off (``disable_by_batch_size``, or a range of k 0)."""
    prefilled: int = 0
    """Prompt tokens computed (cached ones left out) by the sequences whose prefill the
    step ended: with ``tokens``, vLLM's tokens per engine step."""


LoopEvent = Dispatched | BatchDone | Expired | Answered | DeadLettered | StateChanged | Generated


class LoopObserver(Protocol):
    def notify(self, event: LoopEvent) -> None:
        """React to one event (ignore the kinds you do not need)."""
        ...


class NullObserver:
    """Hears everything, does nothing (a feature that is turned off)."""

    def notify(self, event: LoopEvent) -> None:
        pass


class Observers:
    """Fans each event out to many observers, isolating their failures."""

    def __init__(self, observers: Sequence[LoopObserver] = ()) -> None:
        self.observers = list(observers)

    def notify(self, event: LoopEvent) -> None:
        for obs in self.observers:
            try:
                obs.notify(event)
            except Exception:
                logger.exception(
                    "observer %s failed on %s", type(obs).__name__, type(event).__name__
                )
