"""The executor: runs a model's steps on its device thread, one at a time, in order.

It only executes: no Redis, no observers, no request state. Each finished step goes back
to the loop as a :class:`~.inbox.StepDone` with the times it began and ended.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from .inbox import StepDone
from .runner import Failed, Runner, StepReport, Work

logger = logging.getLogger(__name__)


class Executor:
    """A device thread fed through a FIFO (the scheduler keeps at most two steps in it)."""

    def __init__(
        self,
        runner: Runner,
        clock: Callable[[], float],
        post: Callable[[StepDone], None],
        name: str = "device",
    ) -> None:
        self.runner = runner
        self._clock = clock
        self._post = post
        self._queue: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

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
            self._post(execute(self.runner, work, self._clock))


def execute(runner: Runner, work: Work, clock: Callable[[], float]) -> StepDone:
    """Run one step, timed; a runner that raises fails every request of the step."""
    started = clock()
    try:
        report = runner.step(work)
    except Exception as exc:  # runners report request failures; this is a runner bug
        logger.exception("step %s crashed in %s", work.step_id, type(runner).__name__)
        message = f"{type(exc).__name__}: {exc}"
        report = StepReport(events=[Failed(key, message) for key, _ in work.admit], calls=0)
    return StepDone(work.step_id, report, started, clock())
