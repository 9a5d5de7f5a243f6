"""Carrying out the scheduler's decisions, and taking finished steps back.

The loop thread asks the scheduler what to do now; this answers what expired, submits the
step to the device thread (observers hear of it when the device begins it), plans again a
step queued behind the running one when new requests may join it, and answers a one-shot
runner's finished step (a generating runner's goes to :class:`~.generating.Generating`).
Kept apart from ``loop.py``, which owns the loop thread, its lifecycle and its events;
one :class:`Stepper` serves the parts and scheduler of one run of the loop (a reset makes
a new one), from the loop thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..schemas.errors import ErrorCode
from .answers import Answerer, BatchRun, Held, Outgoing
from .gen_scheduler import GenScheduler
from .generating import Generating
from .inbox import StepDone
from .observers import BatchDone, Dispatched, Expired, Observers
from .parts import Parts
from .runner import Failed, Final, Partial, Runner
from .scheduler import Decision, Scheduler, Step
from .streamed import Streamed
from .streams import Entry

logger = logging.getLogger(__name__)


class Stepper:
    """Dispatches one model's steps and answers them as they finish (loop thread only)."""

    def __init__(
        self,
        model: str,
        runner: Runner,
        scheduler: Scheduler | GenScheduler,
        parts: Parts,
        generating: Generating,
        answers: Answerer,
        observers: Observers,
        *,
        continuous: bool,
        dispatching: Callable[[], bool],
    ) -> None:
        self.model = model
        self.runner = runner
        self.scheduler = scheduler
        self.parts = parts
        self.generating = generating
        self.answers = answers
        self.observers = observers
        self.continuous = continuous
        self._dispatching = dispatching
        """False once the loop stops: nothing new is dispatched, what expires is answered."""
        self._unannounced: dict[str, Step] = {}
        """Steps queued behind the running one (planned ahead): observers hear of each when
        it starts; one withdrawn before it starts (planned again) never was."""

    def next_step(self, now: float | None = None) -> Decision:
        """Decide and carry it out: answer what expired, dispatch the next step. Also called
        by a generating model's step end, with the step's state taken in and its answers
        not yet built (its device waits for this, not for them)."""
        now = self.parts.clock() if now is None else now
        decision = self._decide(now)
        if decision.step is not None and getattr(self.scheduler, "ahead", False):
            self._decide(now)  # and the one after it, queued behind it (gen_scheduler.py)
        return decision

    def _decide(self, now: float) -> Decision:
        decision = self.scheduler.decide(
            now, behind=self.parts.sink.backlog > 1, dispatch=self._dispatching()
        )
        if decision.expired:
            self._expire(decision.expired, now)
        if decision.refused:
            self._refuse(decision.refused, now)
        if decision.step is not None:
            self._dispatch(decision.step, now)
        return decision

    def _dispatch(self, step: Step, now: float) -> None:
        batch = step.batch
        logger.debug(
            "batch %s of %s: %d requests, %d rows, %d padded tokens, reason %s",
            step.step_id, self.model, len(step.held), batch.rows, batch.padded_tokens, batch.reason,
        )  # fmt: skip
        if self.continuous:
            self.generating.dispatching(step)
        self.parts.device.submit(step.work())
        if isinstance(self.scheduler, GenScheduler) and self.scheduler.queued == step.step_id:
            self._unannounced[step.step_id] = step
        else:
            self._announce(step, now)

    def _announce(self, step: Step, now: float) -> None:
        if self.continuous:
            self.generating.began(step)
        ids = tuple(h.request.id for h in step.held)
        self.observers.notify(Dispatched(self.model, step.batch, step.step_id, ids, now))

    def _expire(self, expired: Sequence[Held], now: float) -> None:
        self._send_unrun([self.answers.expired(h, now) for h in expired], expired)
        self.observers.notify(
            Expired(self.model, tuple(h.request.id for h in expired),
                    tuple(h.entry.lane for h in expired), now)
        )  # fmt: skip

    def _refuse(self, refused: Sequence[tuple[Held, str]], now: float) -> None:
        """Requests the scheduler found can never run here: ``invalid_request``."""
        for h, why in refused:
            logger.info("request %s of %s refused: %s", h.request.id, self.model, why)
        held = [h for h, _ in refused]
        self._send_unrun([self.answers.refused(h, why, now) for h, why in refused], held)

    def _send_unrun(self, answers: list[Outgoing], held: Sequence[Held]) -> None:
        """Answers of requests never computed; a generating model's are stored as this
        attempt's, with the token stream's end."""
        if self.continuous:
            answers = [self.generating.attempt(a, h, 1) for a, h in zip(answers, held, strict=True)]
        self.parts.sink.send(answers)

    # --- a step queued ahead ----------------------------------------------------------------

    def may_join(self, entries: Sequence[Entry]) -> bool:
        """New requests the queued step (planned ahead) might admit if planned again: a
        lane-0 one (it may preempt), or any that found nothing waiting and a free slot. With
        a backlog (saturated) the plan already left others waiting, and planning again for
        each arrival cost the device about 8% of its throughput (tiny model, 2 cores: the
        loop's planning beside the step's Python)."""
        gen = self.scheduler
        if not isinstance(gen, GenScheduler) or gen.queued is None:
            return False
        if any(e.lane == 0 for e in entries):
            return True
        return gen.room and len(gen.held) <= len(entries)

    def replan(self) -> None:
        """Requests came that may join (:meth:`may_join`), or a client cancelled, while a
        step waits queued behind the running one (planned ahead): plan it again with them,
        unless the device has taken it meanwhile (then they go with the step after)."""
        if not isinstance(self.scheduler, GenScheduler):
            return
        queued = self.scheduler.queued
        if queued is None:
            return
        dropped = self.parts.device.drop_queued()
        if not dropped:
            return
        *first, last = dropped
        for work in first:  # the step before it, ended but not yet taken by the device thread
            self.parts.device.submit(work)
        if last.step_id != queued:
            raise RuntimeError(f"took back {[w.step_id for w in dropped]}, queued {queued}")
        self.scheduler.withdraw(queued)
        self._unannounced.pop(queued, None)
        self.next_step()

    def _started_next(self) -> Decision:
        """A generating model's step ended and the one queued behind it started: observers
        hear of that one now; then plan the next."""
        assert isinstance(self.scheduler, GenScheduler)
        now = self.parts.clock()
        if self.scheduler.inflight:
            step = self._unannounced.pop(self.scheduler.inflight[0].step_id, None)
            if step is not None:
                self._announce(step, now)
        return self.next_step(now)

    # --- a finished step --------------------------------------------------------------------

    def finished(self, done: StepDone) -> None:
        """The device thread finished a step: answer the requests it ended."""
        if not isinstance(self.scheduler, Scheduler):
            self.generating.finished(done, self._started_next)
            return
        step = self.scheduler.finished(done.step_id, done.report, done.started_at, done.finished_at)
        now = self.parts.clock()
        run = BatchRun(step.step_id, step.batch.rows, done.started_at, done.finished_at)
        by_key = {h.waiting.key: h for h in step.held}
        out: list[Outgoing] = []
        streamed: list[Streamed] = []
        seqs: dict[str, int] = {}
        failed = 0
        for ev in done.report.events:
            held = by_key.pop(ev.key, None)
            if held is None:
                continue
            if isinstance(ev, Final) and (
                not isinstance(ev.outputs, list) or len(ev.outputs) != len(held.request.inputs)
            ):
                failed += 1
                got = len(ev.outputs) if isinstance(ev.outputs, list) else type(ev.outputs).__name__
                message = f"runner returned {got} outputs for {len(held.request.inputs)} inputs"
                out.append(self.answers.failed(run, held, ErrorCode.INFERENCE_FAILED, message, now))
            elif isinstance(ev, Final):
                out.append(self.answers.computed(run, held, ev.outputs, now))
            elif isinstance(ev, Failed):
                failed += 1
                out.append(self.answers.failed(run, held, ev.code, ev.message, now))
            elif isinstance(ev, Partial):
                by_key[ev.key] = held  # not finished by this step
                seqs[ev.key] = seqs.get(ev.key, 0) + 1
                streamed.append(self.generating.delta(held, seqs[ev.key], ev.chunk))
        for held in by_key.values():  # a one-shot runner must finish every request it admits
            failed += 1
            message = f"runner {self.runner.name} returned no output for it"
            out.append(self.answers.failed(run, held, ErrorCode.INFERENCE_FAILED, message, now))
        self.observers.notify(
            BatchDone(self.model, step.batch, step.step_id, tuple(h.request.id for h in step.held),
                      done.finished_at - done.started_at, done.report.out_of_memory, failed)
        )  # fmt: skip
        self.parts.sink.stream(streamed)
        self.parts.sink.send(out)
