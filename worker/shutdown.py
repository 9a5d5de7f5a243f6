"""How a batch loop ends: what it still finishes, and what it hands back to the fleet.

A stopping loop stops reading and hands back at once every request not yet on the device
(:func:`hand_back`); when the loop ends (a stop, a drain, a crash) its threads stop —
the device's step in flight waited for up to the grace (:func:`stop_threads`) — and
:func:`hand_over` answers what finished, releases everything else to the fleet (other
workers read it at once, not after ``claim_idle_ms``) and lets the sink store all it was
given. Kept apart from ``loop.py``, which decides when; these run on the loop thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

from ..redis_errors import FAILED_CALL
from .gen_scheduler import GenScheduler
from .inbox import Arrived, Retire, StepDone
from .parts import Parts, Source
from .scheduler import Scheduler
from .streams import Entry

logger = logging.getLogger(__name__)

HEARTBEAT_JOIN_S = 2.0
"""At shutdown, how long to wait for the intake's read in flight to return (it never
blocks longer than a heartbeat)."""


def release(source: Source, entries: Sequence[Entry]) -> None:
    """Hand ``entries`` back to the fleet; if Redis fails, they stay pending and are
    reclaimed later."""
    try:
        source.release(entries)
    except FAILED_CALL as exc:
        logger.warning("could not release %d requests: %s", len(entries), exc)


def hand_back(parts: Parts, scheduler: Scheduler | GenScheduler) -> None:
    """Stopping: stop reading, and hand every request not yet on the device back to the
    fleet at once (held ones, and steps queued behind the running one)."""
    parts.source.stop()
    queued = parts.device.drop_queued()
    unstarted = [h.entry for h in scheduler.cancel([w.step_id for w in queued])]
    unstarted += [h.entry for h in scheduler.release_all()]
    release(parts.source, unstarted)


def stop_threads(parts: Parts, started: Sequence[str], grace: float) -> bool:
    """The loop ended: stop reading, and let the device finish its step within ``grace``.
    True: the device thread is still in a step (stuck; see ``BatchLoop.settle``)."""
    if "source" in started:
        parts.source.stop()
        parts.source.join(min(grace, HEARTBEAT_JOIN_S))
    if "threads" not in started:
        return False
    if parts.cancels is not None:
        parts.cancels.stop()
    parts.device.close(grace)
    return parts.device.alive


def hand_over(
    parts: Parts,
    scheduler: Scheduler | GenScheduler,
    started: Sequence[str],
    grace: float,
    finished: Callable[[StepDone], None],
) -> None:
    """After :func:`stop_threads`: answer the steps that finished, hand everything else
    back (held, read and never taken in, on a device that did not stop in time, a
    generation cut short), then let the sink store all it was given within ``grace``."""
    unstarted = [h.entry for h in scheduler.release_all()]
    while (event := parts.inbox.get_nowait()) is not None:
        if isinstance(event, StepDone):
            try:
                finished(event)
            except Exception:
                logger.exception("answering step %s at shutdown failed", event.step_id)
        elif isinstance(event, Arrived):  # read, never taken in
            unstarted += event.entries
        elif isinstance(event, Retire):
            parts.sink.retire(event.items)
    # Steps the device never finished (it did not stop in time): their requests go back.
    unstarted += [h.entry for step in scheduler.inflight for h in step.held]
    scheduler.inflight.clear()
    if isinstance(scheduler, GenScheduler):  # generations cut short: start again elsewhere
        unstarted += [h.entry for h in scheduler.release_running()]
    if "source" in started:
        release(parts.source, unstarted)
    if "threads" in started:
        parts.sink.close(grace)
    if "source" in started:
        with contextlib.suppress(*FAILED_CALL):
            parts.source.unregister()
