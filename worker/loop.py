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

This module owns the loop's state and lifecycle (start, stop, drain, pause, a crash's
reset) and routes the inbox's events; the work it routes them to lives beside it:
``admission.py`` takes new entries in, ``stepping.py`` carries out the scheduler's
decisions and answers finished steps (``generating.py`` a generating runner's), and
``shutdown.py`` ends the loop, handing back to the fleet what it did not finish.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ..batching.engine import Engine
from ..batching.gen_types import GenPolicy
from ..batching.generation import GenerationPolicy
from ..batching.lanes import split_budget
from ..batching.types import Policy
from ..config import ModelConfig, WorkerConfig
from ..connection import SyncClient
from .admission import Admission
from .answers import Answerer
from .crashes import RUNNER_BROKEN_AFTER
from .gen_scheduler import GenScheduler
from .generating import Generating
from .holding import HAND_OVER_EVERY_S, HoldingFeed
from .inbox import (
    IDLE_REPORTS,
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
from .observers import LoopObserver, Observers, StateChanged
from .parts import Parts, redis_parts
from .runner import Runner, is_continuous
from .scheduler import Scheduler
from .shutdown import hand_back, hand_over, stop_threads
from .stats import LoopStats
from .stepping import Stepper
from .streams import ModelStreams

logger = logging.getLogger(__name__)


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
        self.admission = Admission(model, config, self.worker, runner, self.answers, self.stats)
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
        self.parts = parts(self)
        if self.continuous and self.parts.deltas is None:
            raise ValueError("a generating runner's parts need a DeltaWriter (Parts.deltas)")
        self.generating = Generating(model, config, gen, self.answers, self.observers,
                                     self.parts, self._now)  # fmt: skip
        self.stepper = self._stepper()

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

    def broken(self) -> int | None:
        """Steps in a row its runner raised, once that many take it for broken (its
        requests failed, :mod:`.crashes`; the worker's ``/livez`` fails, so the
        orchestrator restarts it), else None. Any thread."""
        crashed = self.parts.device.crashed_in_a_row
        return crashed if crashed >= RUNNER_BROKEN_AFTER else None

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
        self._stopped.clear()
        self._device_gone = False
        self._stuck_since = None
        forget = getattr(self.runner, "forget_all", None)
        if forget is not None and not self.parts.device.alive:  # (see settle)
            forget()  # what it held is read again: a generator starts it over
        self.parts = self._make_parts(self)
        self.generating = Generating(self.model, self.config, gen, self.answers, self.observers,
                                     self.parts, self._now)  # fmt: skip
        self.stepper = self._stepper()

    def _stepper(self) -> Stepper:
        """Carries out the scheduler's decisions for these parts (made again at a reset)."""
        return Stepper(self.model, self.runner, self.scheduler, self.parts, self.generating,
                       self.answers, self.observers, continuous=self.continuous,
                       dispatching=lambda: not self._stopping)  # fmt: skip

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
            decision = self.stepper.next_step(now)
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
        hand_back(self.parts, self.scheduler)

    def _done(self) -> bool:
        if self._stopping:
            return True
        if self._draining:
            return not self.scheduler.held
        burst_done = self.burst and not self.scheduler.held and self._idle_reads >= IDLE_REPORTS
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
            self.stepper.finished(event)
        elif isinstance(event, DeviceStopped):
            logger.error("batch loop of %s stops: its device thread ended in step %s (%s)",
                         self.model, event.step_id, event.reason)  # fmt: skip
            self._device_gone = True
            self.stop()
        elif isinstance(event, Arrived):
            self._arrivals += 1
            self._idle_reads = 0
            self.admission.admit(
                event.entries, event.read_at, self.scheduler.admit, self.parts.sink
            )
            if event.cancelled:
                self.generating.cancel(event.cancelled)
            if event.cancelled or self.stepper.may_join(event.entries):
                self.stepper.replan()
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
            self.stepper.replan()
        elif isinstance(event, Lost) and self.generating.lose({e.key for e in event.entries}):
            self.stepper.replan()  # (an encoder's lost requests are answered once, first come)

    def _shutdown(self, started: list[str]) -> None:
        """Whatever ended the loop (a stop, a drain, a crash): finish what the device runs,
        answer it, hand everything else back, then let the sink store all it was given."""
        parts = self.parts
        grace = 0.0 if self._terminating else self.worker.shutdown_grace_s
        if stop_threads(parts, started, grace):  # a step stuck in the device: see settle()
            self._stuck_since = self.scheduler.busy_since or parts.clock()
        hand_over(parts, self.scheduler, started, grace, self.stepper.finished)
        self._stopped.set()
        logger.info("batch loop for %s stopped", self.model)


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
