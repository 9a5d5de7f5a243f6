"""The batch loop of one model: the one thread that owns its request state.

Four parts, one module each, meet here:

- the **intake** (``intake.py``) reads entries on its own thread and posts them;
- the **scheduler** (``scheduler.py``) holds the requests and decides, from its state and
  the time, what to dispatch, what to expire and when to look again;
- the **executor** (``executor.py``) runs each step on the device thread and posts it back;
- the **sink** (``sink.py``) stores, publishes and acks results on its writer thread.

The loop waits on one inbox for what those threads post (entries, finished steps, stored
batches), hands each to the scheduler, and carries out its decisions. Only this thread
touches the scheduler, so nothing in it needs a lock; the time comes from an injected
clock, so the same loop runs in virtual time in the tests.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from ..batching.engine import Engine
from ..batching.generation import GenerationPolicy, GenPolicy
from ..batching.lanes import split_budget
from ..batching.types import Policy
from ..config import ModelConfig, WorkerConfig
from ..connection import SyncClient
from ..redis_errors import FAILED_CALL
from ..schemas.codec import EntryRejected, decode_entry, envelope_of
from ..schemas.errors import ErrorCode
from ..schemas.messages import Format, Request
from .answers import Answerer, BatchRun, Held, Outgoing, dead_reason, waiting_of
from .blobs import with_fetched
from .gen_scheduler import GenScheduler
from .generating import Generating
from .holding import HAND_OVER_EVERY_S, HoldingFeed
from .inbox import (
    Arrived,
    Cancel,
    DeviceStopped,
    Event,
    Lost,
    ReadIdle,
    Retire,
    SetPolicy,
    StepDone,
    Wake,
)
from .observers import (
    BatchDone,
    Dispatched,
    Expired,
    LoopObserver,
    Observers,
    StateChanged,
)
from .parts import Parts, redis_parts
from .runner import Failed, Final, Partial, Prepared, PrepareError, Runner, is_continuous
from .scheduler import Decision, Scheduler, Step
from .sink import Streamed
from .stats import LoopStats
from .streams import Entry, ModelStreams

logger = logging.getLogger(__name__)

HEARTBEAT_JOIN_S = 2.0
"""At shutdown, how long to wait for the intake's read in flight to return (it never
blocks longer than a heartbeat)."""


class BatchLoop:
    """Serves one model from its lane streams until stopped (or, in burst mode, until idle)."""

    def __init__(
        self,
        model: str,
        config: ModelConfig,
        runner: Runner,
        client: SyncClient | None = None,
        *,
        consumer: str,
        worker: WorkerConfig | None = None,
        burst: bool = False,
        observers: Sequence[LoopObserver] = (),
        parts: Callable[[BatchLoop], Parts] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.runner = runner
        if hasattr(runner, "input_limits"):  # runners that decode images take the model's
            runner.input_limits = config.limits.inputs
        self.worker = worker or WorkerConfig()
        self.consumer = consumer
        self.burst = burst
        self.engine = Engine(config.batch.policy(config.lanes))
        self.continuous = is_continuous(runner)
        gen = _gen_scheduler(runner, self.engine, config.lanes) if self.continuous else None
        self.scheduler: Scheduler | GenScheduler = gen or Scheduler(self.engine)
        self.configured_budgets = gen.policy.policy if gen else None
        """A generating model's budgets as its fleet file set them: live changes
        (``bf_policy``) may lower them, or raise them back up to these."""
        self.stats = LoopStats(model=model, lanes=config.lanes)
        self.observers = Observers([self.stats, *observers])
        self.answers = Answerer(model, config, consumer)
        self.streams: ModelStreams | None = None
        if parts is None:
            if client is None:
                raise ValueError("BatchLoop needs a Redis client or injected parts")
            self.streams = ModelStreams(client, model, config.lanes, consumer)
            parts = _redis_parts
        self._make_parts = parts
        self._paused = False
        self._draining = False
        self._stopping = False
        self._terminating = False
        self._device_gone = False
        self._stopped = threading.Event()
        self._stuck_since: float | None = None
        """The loop ended with its device thread still in a step (begun then): see :meth:`settle`."""
        self._unannounced: dict[str, Step] = {}
        """Steps queued behind the running one (planned ahead): observers hear of each when
        it starts; one withdrawn before it starts (planned again) never was."""
        self.parts = parts(self)
        if self.continuous and self.parts.deltas is None:
            raise ValueError("a generating runner's parts need a DeltaWriter (Parts.deltas)")
        self.generating = Generating(model, config, gen, self.answers, self.observers,
                                     self.parts, self._now)  # fmt: skip

    def _now(self) -> float:
        return self.parts.clock()

    # --- control (any thread) ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop reading; running steps finish and are stored before ``run`` returns."""
        self._stopping = True
        self._state("stopping")

    def terminate(self) -> None:
        """Stop at once (a cold shutdown): as :meth:`stop`, but the step on the device is not
        waited for, nor a generation's grace: its requests go back to the fleet too. Safe in a
        signal handler: it only sets flags and wakes the loop (no observer hears of it)."""
        self._terminating = True
        self._stopping = True
        self.parts.inbox.put(Wake())

    def pause(self) -> None:
        """Stop reading new entries; what this worker already holds is still answered."""
        self._paused = True
        self._state("paused")

    def resume(self) -> None:
        self._paused = False
        self._state("running")

    def drain(self) -> None:
        """Stop reading, answer everything held, then stop (``run`` returns)."""
        self._draining = True
        self._state("draining")

    def set_policy(self, policy: Policy | GenPolicy) -> None:
        """Change the batch policy live (the engine keeps what it learnt), or a generating
        model's budgets (see ``GenScheduler.set_budgets``)."""
        self.parts.inbox.put(SetPolicy(policy))

    @property
    def budgets(self) -> GenPolicy | None:
        """A generating model's budgets now (None: not a generator)."""
        return self.scheduler.policy.policy if isinstance(self.scheduler, GenScheduler) else None

    def _state(self, state: str) -> None:
        self.observers.notify(StateChanged(self.model, state))
        self.parts.inbox.put(Wake())

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def state(self) -> str:
        if self._draining:
            return "draining"
        return "paused" if self._paused else "running"

    @property
    def held(self) -> int:
        """Requests read and not yet dispatched (the running batch not included)."""
        return len(self.scheduler.held)

    def hung_for(self) -> float | None:
        """Seconds its device step has run past ``claim_idle_ms`` (a hung device: the
        worker's ``/livez`` fails, so the orchestrator restarts it), else None. Any thread.
        Also while a crashed loop waits for its device thread (:meth:`settle`)."""
        hung = self.parts.source.hung_for()
        since = self._stuck_since
        if hung is None and since is not None and self.parts.device.alive:
            ran = self._now() - since
            if ran * 1000 > self.worker.claim_idle_ms:
                return ran
        return hung

    def settle(self, poll_s: float = 1.0) -> bool:
        """After a crash, before :meth:`reset`: wait until the device thread has left the step
        it was running (a step stuck in the device must not run beside a new device thread on
        the same model, nor write its deltas after the restarted requests' ``reset``); the
        worker reports the device hung meanwhile (:meth:`hung_for`). False: the loop was
        stopped while waiting (then do not reset it)."""
        device = self.parts.device
        if device.alive:
            logger.warning("batch loop of %s: waiting for its device thread to end its step "
                           "before starting again", self.model)  # fmt: skip
        while device.alive:
            if self._stopping:
                return False
            device.wait(poll_s)
        return True

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def reset(self) -> None:
        """After a crash: forget what was held (it stays pending in Redis and is reclaimed)."""
        gen = (
            _gen_scheduler(self.runner, self.engine, self.config.lanes) if self.continuous else None
        )
        if gen is not None and isinstance(self.scheduler, GenScheduler):
            gen.set_budgets(self.scheduler.policy.policy)  # live changes are kept
        self.scheduler = gen or Scheduler(self.engine)
        self._unannounced.clear()
        self._stopped.clear()
        self._device_gone = False
        self._stuck_since = None
        forget = getattr(self.runner, "forget_all", None)
        if forget is not None and not self.parts.device.alive:  # (see settle)
            forget()  # what it held is read again: a generator starts it over
        self.parts = self._make_parts(self)
        self.generating = Generating(self.model, self.config, gen, self.answers, self.observers,
                                     self.parts, self._now)  # fmt: skip

    # --- the loop (its own thread) ----------------------------------------------------------

    def run(self) -> None:
        parts = self.parts
        self._clock = parts.clock
        self._arrivals = 0
        self._idle_reads = 0
        self._handed_back = False
        self._give_up_at = float("inf")
        every = min(HAND_OVER_EVERY_S, self.worker.claim_idle_ms / 4000)
        self._feed = HoldingFeed(parts.source.hold, every)
        started: list[str] = []
        try:
            parts.source.start(self.config.max_queue_depth)  # Redis first: may fail, no threads yet
            started.append("source")
            parts.sink.start()
            parts.device.start()
            if parts.cancels is not None:
                parts.cancels.start()
            started.append("threads")
            logger.info("batch loop for %s started as %s", self.model, self.consumer)
            self._serve()
        finally:
            self._shutdown(started)

    def _serve(self) -> None:
        inbox = self.parts.inbox
        while True:
            if self._stopping and not self._handed_back:
                self._hand_back()
            if self._terminating or self._device_gone:
                return  # what the device runs (if anything) goes back, unwaited for
            now = self._clock()
            decision = self._next_step(now)
            # what is held now, so the intake keeps it from others' idle fallback
            hold_at = self._feed.update(self.scheduler, now)
            if not self.scheduler.busy and self._done():
                return
            if self._stopping and self.continuous and now >= self._give_up_at:
                return  # generations still running past the grace go back to the fleet
            self.generating.watch()
            self._grant()
            wake_at = decision.wake_at
            if hold_at is not None:  # a handover deferred: make it even if nothing comes
                wake_at = hold_at if wake_at is None else min(wake_at, hold_at)
            timeout = None if wake_at is None else max(0.0, wake_at - self._clock())
            event = inbox.get(timeout)
            while event is not None:
                self._handle(event)
                event = inbox.get_nowait()

    def _hand_back(self) -> None:
        """Stopping: stop reading, and hand every request not yet on the device back to the
        fleet at once (held ones, and steps queued behind the running one)."""
        self._handed_back = True
        self._give_up_at = self._clock() + self.worker.shutdown_grace_s
        self.parts.source.stop()
        queued = self.parts.device.drop_queued()
        unstarted = [h.entry for h in self.scheduler.cancel([w.step_id for w in queued])]
        unstarted += [h.entry for h in self.scheduler.release_all()]
        self._release(unstarted)

    def _release(self, entries: list[Entry]) -> None:
        try:
            self.parts.source.release(entries)
        except FAILED_CALL as exc:  # they stay pending and are reclaimed later
            logger.warning("could not release %d requests: %s", len(entries), exc)

    def _done(self) -> bool:
        if self._stopping:
            return True
        if self._draining:
            return not self.scheduler.held
        burst_done = self.burst and not self.scheduler.held and self._idle_reads >= 2
        return burst_done and self.parts.sink.backlog == 0

    def _grant(self) -> None:
        """Tell the intake how much to read now."""
        counts: dict[int, int] = {}
        if not (self._paused or self._draining or self._stopping):
            budget = self.scheduler.read_budget()
            if budget > 0:
                counts = split_budget(budget, range(self.config.lanes), self.engine.policy)
            counts[0] = max(counts.get(0, 0), self.scheduler.lane0_reads())
        self.parts.source.grant(counts, not self.scheduler.holds_suspect, self._arrivals)

    def _handle(self, event: Event) -> None:
        if isinstance(event, StepDone):
            self._finished(event)
        elif isinstance(event, DeviceStopped):
            logger.error("batch loop of %s stops: its device thread ended in step %s (%s)",
                         self.model, event.step_id, event.reason)  # fmt: skip
            self._device_gone = True
            self.stop()
        elif isinstance(event, Arrived):
            self._arrivals += 1
            self._idle_reads = 0
            self._admit(event.entries, event.read_at)
            if event.cancelled:
                self.generating.cancel(event.cancelled)
            if event.cancelled or self._may_join(event.entries):
                self._replan()
        elif isinstance(event, Retire):
            self.parts.sink.retire(event.items)
        elif isinstance(event, ReadIdle):
            self._idle_reads += 1
        elif isinstance(event, SetPolicy):
            if isinstance(event.policy, GenPolicy):
                if isinstance(self.scheduler, GenScheduler):
                    self.scheduler.set_budgets(event.policy)
            else:
                self.engine.set_policy(event.policy)
        elif isinstance(event, Cancel):
            self.generating.cancel(event.request_ids)
            self._replan()
        elif isinstance(event, Lost) and self.generating.lose({e.key for e in event.entries}):
            self._replan()  # (an encoder's lost requests are answered once, first come)

    def _shutdown(self, started: list[str]) -> None:
        """Whatever ended the loop (a stop, a drain, a crash): finish what the device runs,
        answer it, hand everything else back, then let the sink store all it was given."""
        parts = self.parts
        grace = 0.0 if self._terminating else self.worker.shutdown_grace_s
        if "source" in started:
            parts.source.stop()
            parts.source.join(min(grace, HEARTBEAT_JOIN_S))
        if "threads" in started:
            if parts.cancels is not None:
                parts.cancels.stop()
            parts.device.close(grace)
            if parts.device.alive:  # a step stuck in the device: see settle()
                self._stuck_since = self.scheduler.busy_since or parts.clock()
        unstarted = [h.entry for h in self.scheduler.release_all()]
        while (event := parts.inbox.get_nowait()) is not None:
            if isinstance(event, StepDone):
                try:
                    self._finished(event)
                except Exception:
                    logger.exception("answering step %s at shutdown failed", event.step_id)
            elif isinstance(event, Arrived):  # read, never taken in
                unstarted += event.entries
            elif isinstance(event, Retire):
                parts.sink.retire(event.items)
        # Steps the device never finished (it did not stop in time): their requests go back.
        unstarted += [h.entry for step in self.scheduler.inflight for h in step.held]
        self.scheduler.inflight.clear()
        if isinstance(self.scheduler, GenScheduler):  # generations cut short: start again elsewhere
            unstarted += [h.entry for h in self.scheduler.release_running()]
        if "source" in started:
            self._release(unstarted)
        if "threads" in started:
            parts.sink.close(grace)
        if "source" in started:
            with contextlib.suppress(*FAILED_CALL):
                parts.source.unregister()
        self._stopped.set()
        logger.info("batch loop for %s stopped", self.model)

    # --- admitting --------------------------------------------------------------------------

    def _admit(self, entries: Sequence[Entry], now: float) -> None:
        """Decode, validate and prepare new entries; answer the bad ones at once."""
        limits = self.config.limits
        fresh: list[tuple[Entry, Request, Format]] = []
        out: list[Outgoing] = []
        for entry in entries:
            try:
                request, fmt = decode_entry(entry.fields, self.model, limits)
            except EntryRejected as exc:
                self._reject(entry, exc, now, out)
                continue
            if entry.deliveries > self.worker.max_deliveries:
                reason = dead_reason(entry, self.worker.max_deliveries)
                env = envelope_of(entry.fields, limits)
                self._reject(
                    entry, EntryRejected(reason, ErrorCode.POISONED, env), now, out, dead=True
                )
                continue
            fresh.append((entry, with_fetched(request, entry.blobs), fmt))
        prepared = self._prepare([req for _, req, _ in fresh]) if fresh else []
        admit = self.scheduler.admit
        lanes: list[int] = []
        for (entry, request, fmt), prep in zip(fresh, prepared, strict=True):
            if isinstance(prep, PrepareError):
                out.append(self.answers.error(entry, request, fmt, prep.code, str(prep), now))
                continue
            admit(Held(entry, request, fmt, prep, waiting_of(entry, request, prep), now))
            lanes.append(entry.lane)
        self.stats.received(lanes)
        self.parts.sink.send(out)

    def _prepare(self, requests: list[Request]) -> list[Prepared | PrepareError]:
        """The runner's CPU side; a runner that raises or miscounts fails the requests."""
        try:
            prepared = self.runner.prepare_many(requests)
            if len(prepared) == len(requests):
                return prepared
            problem = f"returned {len(prepared)} prepared for {len(requests)} requests"
        except Exception as exc:
            logger.exception("runner %s failed to prepare requests", self.runner.name)
            problem = f"failed: {type(exc).__name__}: {exc}"
        error = PrepareError(f"runner {self.runner.name} {problem}", ErrorCode.INTERNAL)
        return [error] * len(requests)

    def _reject(
        self,
        entry: Entry,
        exc: EntryRejected,
        now: float,
        out: list[Outgoing],
        dead: bool = False,
    ) -> None:
        """An entry that will not be computed: answer it when its id can be read; dead-letter
        it when it cannot (nobody to answer), or when ``dead`` (poison: operators look). The
        answer goes first: dead-lettering removes the entry, and it must not go unanswered."""
        self.stats.rejected(exc.code.value)
        answer = self.answers.rejected(entry, exc, now)
        if answer is not None and dead:
            self.parts.sink.send([answer])
        elif answer is not None:
            out.append(answer)
        if dead or answer is None:
            self.parts.sink.dead_letter(entry, exc.code.value, str(exc))

    # --- computing --------------------------------------------------------------------------

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

    def _may_join(self, entries: Sequence[Entry]) -> bool:
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

    def _replan(self) -> None:
        """Requests came that may join (:meth:`_may_join`), or a client cancelled, while a
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
        self._next_step()

    def _started_next(self) -> Decision:
        """A generating model's step ended and the one queued behind it started: observers
        hear of that one now; then plan the next."""
        assert isinstance(self.scheduler, GenScheduler)
        now = self._clock()
        if self.scheduler.inflight:
            step = self._unannounced.pop(self.scheduler.inflight[0].step_id, None)
            if step is not None:
                self._announce(step, now)
        return self._next_step(now)

    def _finished(self, done: StepDone) -> None:
        if not isinstance(self.scheduler, Scheduler):
            self.generating.finished(done, self._started_next)
            return
        step = self.scheduler.finished(done.step_id, done.report, done.started_at, done.finished_at)
        now = self._clock()
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

    def _next_step(self, now: float | None = None) -> Decision:
        """Decide and carry it out: answer what expired, dispatch the next step. Also called
        by a generating model's step end, with the step's state taken in and its answers
        not yet built (its device waits for this, not for them)."""
        now = self._clock() if now is None else now
        decision = self._decide(now)
        if decision.step is not None and getattr(self.scheduler, "ahead", False):
            self._decide(now)  # and the one after it, queued behind it (gen_scheduler.py)
        return decision

    def _decide(self, now: float) -> Decision:
        decision = self.scheduler.decide(
            now, behind=self.parts.sink.backlog > 1, dispatch=not self._stopping
        )
        if decision.expired:
            self._expire(decision.expired, now)
        if decision.step is not None:
            self._dispatch(decision.step, now)
        return decision

    def _expire(self, expired: Sequence[Held], now: float) -> None:
        answers = [self.answers.expired(h, now) for h in expired]
        if self.continuous:  # stored as this attempt's, with the token stream's end
            answers = [
                self.generating.attempt(a, h, 1) for a, h in zip(answers, expired, strict=True)
            ]
        self.parts.sink.send(answers)
        self.observers.notify(
            Expired(self.model, tuple(h.request.id for h in expired),
                    tuple(h.entry.lane for h in expired), now)
        )  # fmt: skip


def _gen_scheduler(runner: Runner, engine: Engine, lanes: int) -> GenScheduler:
    """The scheduler of a generating runner, with the budgets it states."""
    policy = engine.policy
    budgets = runner.generation_policy(  # type: ignore[attr-defined]
        lanes, policy.lane_weights, policy.max_starvation_ms
    )
    ahead = bool(getattr(runner, "schedule_ahead", False))
    return GenScheduler(GenerationPolicy(budgets), ahead=ahead)


def _redis_parts(loop: BatchLoop) -> Parts:
    assert loop.streams is not None
    return redis_parts(
        loop.streams, loop.runner, loop.config, loop.worker, loop.observers, loop.model
    )
