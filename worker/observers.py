"""Hooks the batch loop calls as work moves through it.

Metrics, Flower task events and webhook deliveries plug in here, so the loop itself
stays one concept. ``on_dispatch`` runs on the loop thread; ``on_batch_done`` and
``on_answered`` run on the model's publisher thread (``on_answered`` also on the loop
thread for rejected or expired requests, never both at once), so an observer's state
must be safe to touch from two threads. Keep hooks cheap and never block on the network
(hand slow work to a queue or another thread). A hook that raises is logged and ignored:
observers can never break inference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..batching.types import Batch
from ..schemas.messages import Request, Result

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Answered:
    """A result the loop has just stored (``stored`` False: one existed already)."""

    lane: int
    request: Request | None
    """None when the entry could not be decoded into a request."""
    result: Result
    stored: bool


class LoopObserver:
    """Base class: override the hooks you need."""

    def on_dispatch(self, model: str, batch: Batch, batch_id: str, now: float) -> None:
        """A micro-batch was handed to the device."""

    def on_batch_done(
        self,
        model: str,
        batch: Batch,
        batch_id: str,
        seconds: float,
        out_of_memory: bool,
        failed: int,
    ) -> None:
        """A micro-batch finished (``failed`` requests in it got an error)."""

    def on_answered(self, model: str, answered: Sequence[Answered]) -> None:
        """Results were stored (and published) for these requests."""

    def on_dead_letter(self, model: str, lane: int, code: str, reason: str) -> None:
        """An entry nobody could be answered for went to the dead-letter stream."""


class Observers(LoopObserver):
    """Fans each hook out to many observers, isolating their failures."""

    def __init__(self, observers: Sequence[LoopObserver] = ()) -> None:
        self.observers = list(observers)

    def _each(self, hook: str, *args: object) -> None:
        for obs in self.observers:
            try:
                getattr(obs, hook)(*args)
            except Exception:
                logger.exception("observer %s failed in %s", type(obs).__name__, hook)

    def on_dispatch(self, model: str, batch: Batch, batch_id: str, now: float) -> None:
        self._each("on_dispatch", model, batch, batch_id, now)

    def on_batch_done(
        self,
        model: str,
        batch: Batch,
        batch_id: str,
        seconds: float,
        out_of_memory: bool,
        failed: int,
    ) -> None:
        self._each("on_batch_done", model, batch, batch_id, seconds, out_of_memory, failed)

    def on_answered(self, model: str, answered: Sequence[Answered]) -> None:
        if answered:
            self._each("on_answered", model, answered)

    def on_dead_letter(self, model: str, lane: int, code: str, reason: str) -> None:
        self._each("on_dead_letter", model, lane, code, reason)
