"""What a runner step that raised means for the requests its runner holds: a bounded
policy, on the device thread, so that steps crashing over and over never leave a request
unanswered, while one bad request does not fail the others.

- A step that raises fails the requests it admitted (:func:`~.executor.execute`): one
  poisonous prompt fails alone, and the running requests go on.
- The runner's state after a crash is suspect: it may have ended a request, or applied a
  stop, whose event was lost with the step (a generating runner hands the events it built
  in a step that raised, deltas, results, failures and preemptions, and its token counts
  over with its next one: :class:`~.runners.gen_state.Unsent`; not those of a report lost
  after the runner returned it). Its stops go again with the next step (the
  scheduler, ``StepReport.crashed`` 1). The first step after it that does not raise
  settles its report at once, and every request the runner should hold but neither its
  events' ends nor its progress name (``StepReport.progress`` names each one it holds, parked
  ones aside) fails. Should that settle raise, the check waits for the next step that
  settles (a part-filled progress would fail running requests it had not reached yet).
- The second step in a row that raises (nothing admitted by it needed to) means the
  runner, not a request, is broken, as an engine-core step error is to vLLM: every request
  it holds (running or parked) fails and the runner is emptied (``forget_all``, as for a
  restarted loop), its rows and KV blocks freed at once.

Every request failed so is *abandoned* (the loop stops it, :data:`~.runner.LOST`, with
its next step, in case the runner still runs it). The count of steps raised in a row is
reported (``StepReport.crashed``) and read by the health probes (:attr:`Crashes.in_a_row`).
"""

from __future__ import annotations

import logging

from .runner import Failed, Final, Preempted, Runner, StepReport, Work, is_continuous

logger = logging.getLogger(__name__)

RUNNER_BROKEN_AFTER = 2
"""Steps raised in a row after which every request the runner holds fails and it is emptied."""


class Crashes:
    """The device thread's account of what its runner holds, and of steps raised in a row."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.continuous = is_continuous(runner)
        self.in_a_row = 0
        """Steps that raised in a row (the device thread writes it; any thread reads it)."""
        self._held: set[str] = set()
        """Requests admitted and not ended: what the runner holds, as its events tell."""
        self._parked: set[str] = set()
        """Of them, those it preempted (kept aside, not in its progress)."""
        self._suspect = False
        """A step raised and no step since settled: the lost-request check is due. A
        settle that raises leaves it due (its progress, part filled, cannot tell a lost
        request from a running one; the executor fails what that step named), so the
        next step that settles checks."""

    def checked(self, work: Work, report: StepReport) -> StepReport:
        """``report`` amended by the policy (see the module's docstring): the requests a
        suspect runner lost, or every one it holds, failed. Settles a report that follows
        a crash (it may raise: a failed hand-off)."""
        if report.crashed:
            self.in_a_row += 1
            report.crashed = self.in_a_row
            self._suspect = self.continuous
            if self.in_a_row >= RUNNER_BROKEN_AFTER:
                self._runner_broken(work, report)
            return report
        self.in_a_row = 0
        if self._suspect:
            report.settle()  # its progress: what the runner holds now (raising: see below)
            self._suspect = False
            self._lost(work, report)
        return report

    def track(self, work: Work, report: StepReport) -> None:
        """Learn what the runner holds after a step handed over (as ``report`` ended up)."""
        if not self.continuous:
            return
        for key, _ in work.admit:
            self._held.add(key)
            self._parked.discard(key)
        for ev in report.events:
            if isinstance(ev, Final | Failed):
                self._held.discard(ev.key)
                self._parked.discard(ev.key)
            elif isinstance(ev, Preempted) and not ev.alone:  # (alone: it runs on)
                self._parked.add(ev.key)

    def _lost(self, work: Work, report: StepReport) -> None:
        """Fail the requests the runner should hold and does not name after the step that
        followed a crash: it ended them in the crashed step, their ends lost with it."""
        ended = {ev.key for ev in report.events if isinstance(ev, Final | Failed | Preempted)}
        named = ended | report.progress.keys()  # (a delta: maybe of a request lost since)
        lost = [k for k in self._held if k not in named and k not in self._parked]
        if lost:
            logger.error("step %s: the runner no longer holds %d requests since a step of "
                         "it raised: failed", work.step_id, len(lost))  # fmt: skip
            _fail(report, lost, "generation lost: a step before this one crashed")

    def _runner_broken(self, work: Work, report: StepReport) -> None:
        """Fail every request the runner holds and empty it (see the module's docstring)."""
        ended = {ev.key for ev in report.events}
        held = [k for k in self._held if k not in ended]
        logger.error("step %s: %d steps in a row raised: the runner is taken for broken, its "
                     "%d requests failed", work.step_id, self.in_a_row, len(held))  # fmt: skip
        _fail(report, held, f"the model's runner crashed in {self.in_a_row} steps in a row")
        self._held.clear()
        self._parked.clear()
        self._suspect = False
        forget = getattr(self.runner, "forget_all", None)
        if forget is not None:
            try:
                forget()
            except Exception:  # the requests stay abandoned: the loop stops them
                logger.exception("emptying the runner after step %s failed", work.step_id)


def _fail(report: StepReport, keys: list[str], message: str) -> None:
    """Fail ``keys`` in ``report``, abandoned (the loop stops them in the runner)."""
    report.events = [*report.events, *(Failed(k, message) for k in keys)]
    report.abandoned = (*report.abandoned, *keys)
