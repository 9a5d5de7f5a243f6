"""The executor: runs a model's steps on its device thread, one at a time, in order.

It only executes: no Redis, no observers, no request state (but what its runner holds,
as the steps' events tell: :mod:`.crashes`). Each finished step goes back to the loop as
a :class:`~.inbox.StepDone` with the times it began and ended, whatever happened in it: a
step whose runner raised, or whose hand-off (its deferred ``settle()``, its deltas)
failed, even when handing it over again fails too, comes back with its requests failed
(and abandoned: the loop stops them in the runner, which may still run them), so the
thread lives on and the loop is never left waiting for a step. Steps that raise over and
over fail every request their runner holds (:mod:`.crashes`). Only a ``SystemExit`` or
``KeyboardInterrupt`` ends the thread, after a :class:`~.inbox.DeviceStopped` (the loop
stops and hands the step's requests back to the fleet).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from .crashes import Crashes
from .inbox import DeviceStopped, StepDone
from .runner import Failed, Runner, StepReport, Work, leaves

logger = logging.getLogger(__name__)

STOPS = (SystemExit, KeyboardInterrupt)
"""What a step may raise that means "stop", not "this step failed"."""

HANDOFF_TRIES = 3
"""Times a step is handed to the loop before it is given up (each after the first with its
unfinished requests failed)."""


class Executor:
    """A device thread fed through a FIFO (the scheduler keeps at most two steps in it)."""

    def __init__(
        self,
        runner: Runner,
        clock: Callable[[], float],
        post: Callable[[StepDone | DeviceStopped], None],
        name: str = "device",
    ) -> None:
        self.runner = runner
        self._clock = clock
        self._post = post
        self._queue: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.crashes = Crashes(runner)

    def start(self) -> None:
        self._thread.start()

    def submit(self, work: Work) -> None:
        self._queue.put(work)

    def drop_queued(self) -> list[Work]:
        """Take back the steps submitted and not started (stopping: they go back to the fleet)."""
        dropped: list[Work] = []
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                return dropped
            if work is not None:
                dropped.append(work)

    @property
    def crashed_in_a_row(self) -> int:
        """Steps in a row whose runner raised (any thread; 0 after one that did not)."""
        return self.crashes.in_a_row

    @property
    def alive(self) -> bool:
        """The device thread runs (started, and not ended by :meth:`close`)."""
        return self._thread.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Finish what was submitted, then end the thread."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` for the thread to end (after :meth:`close`); True once it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            try:
                self._step(work)
            except STOPS as exc:
                logger.error("device thread %s told to stop (%r) in step %s: its requests go "
                             "back to the fleet", self._thread.name, exc, work.step_id)  # fmt: skip
                self._post(DeviceStopped(work.step_id, f"{type(exc).__name__}: {exc}"))
                return

    def _step(self, work: Work) -> None:
        done = execute(self.runner, work, self._clock)
        report = done.report
        for tries in range(1, HANDOFF_TRIES + 1):
            try:
                if tries == 1:
                    report = self.crashes.checked(work, report)  # (may settle it)
                self._post(done)  # a generating runner's deferred settle() runs in it
                break
            except STOPS:
                raise
            except BaseException as exc:  # any failure: the loop must hear of the step
                logger.exception("handing step %s of %s over failed (try %d)", work.step_id,
                                 type(self.runner).__name__, tries)  # fmt: skip
                report = unfinished_failed(work, report, exc)
                done = StepDone(work.step_id, report, done.started_at, self._clock())
        else:
            # the loop waits for it: past claim_idle_ms the device is reported hung (a
            # restart), and its requests go to other workers
            logger.critical("step %s of %s could not be handed over: its loop waits for it "
                            "in vain", work.step_id, type(self.runner).__name__)  # fmt: skip
        self.crashes.track(work, report)


def execute(runner: Runner, work: Work, clock: Callable[[], float]) -> StepDone:
    """Run one step, timed; a runner that raises (anything but a stop: :data:`STOPS`) fails
    the requests the step admitted, and its report says it raised (``crashed``: what it
    means for the others is :mod:`.crashes`' to say)."""
    started = clock()
    try:
        report = runner.step(work)
    except STOPS:
        raise
    except BaseException as exc:  # runners report request failures: a runner bug
        logger.exception("step %s crashed in %s", work.step_id, type(runner).__name__)
        admitted = tuple(key for key, _ in work.admit)
        report = StepReport(events=[Failed(key, _message(exc)) for key in admitted], calls=0,
                            abandoned=admitted, crashed=1)  # fmt: skip
    return StepDone(work.step_id, report, started, clock())


def unfinished_failed(work: Work, report: StepReport, exc: BaseException) -> StepReport:
    """A step whose hand-off failed: its events stand (its deltas may be streamed already;
    a :class:`~.deltas.DeltaWriter` whose write failed retries them), and so do the tokens
    it counted (``produced``); every request it admitted or moved on without ending it
    fails after them, as the runner's state after the step cannot be trusted: abandoned,
    for the loop to stop in the runner with its next step (a generator would otherwise run
    them on, unaccounted). A running request the step did not name (it streams nothing)
    runs on: nothing of it was lost but its progress, which the next report gives whole."""
    ended = {ev.key for ev in report.events if leaves(ev)}
    message = f"finishing the step failed: {_message(exc)}"
    failed: dict[str, Failed] = {}
    for key in [k for k, _ in work.admit] + [ev.key for ev in report.events]:
        if key not in ended and key not in failed:
            failed[key] = Failed(key, message)
    return StepReport(events=[*report.events, *failed.values()], calls=0,
                      out_of_memory=report.out_of_memory, produced=report.produced,
                      abandoned=(*report.abandoned, *failed), crashed=report.crashed)  # fmt: skip


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
