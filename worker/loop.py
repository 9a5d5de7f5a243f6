"""The batch loop of one model: read → plan → infer → publish → ack.

It runs on its own thread inside the Celery worker process, with two helpers: a
"device" thread runs the batches, one at a time, and a "publisher" thread stores,
publishes and acks each finished batch's results. So while batch k computes, the loop
reads, decodes and tokenizes what batch k+1 will hold, and batch k-1's results go out
without waiting for the loop. When the device is due to free up within ``PREQUEUE_S``
the loop plans the next batch and queues it behind the running one, so the device does
not sit idle through the hand-off.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis

from ..batching.engine import Engine
from ..batching.lanes import split_budget
from ..batching.types import Batch, Plan, Policy, Waiting
from ..config import ModelConfig, WorkerConfig
from ..schemas.codec import EntryRejected, decode_entry, envelope_of
from ..schemas.errors import ErrorCode
from ..schemas.messages import Format, Request
from .answers import Answerer, BatchRun, Held
from .handlers.base import Handler
from .inference import BatchOutcome, Failure, run_batch
from .observers import LoopObserver, Observers
from .stats import LoopStats
from .streams import Entry, ModelStreams, RedisClock

logger = logging.getLogger(__name__)

RECLAIM_EVERY_S = 5.0
HEARTBEAT_EVERY_S = 2.0
SHORT_WAIT_S = 0.1
"""On an otherwise quiet server Redis times a blocking read out only on its next event-loop
tick (every 1/hz: 100 ms at the default hz 10), so the last this-long of a wait is polled."""
POLL_S = 0.001
ACTIVE_POLL_S = 0.002
"""While the device runs and requests are held for it, new entries are polled this often."""
PREQUEUE_S = 0.003
"""Plan and queue the next batch when the running one is due to end within this long."""
SUSPECT = 3
"""Deliveries from which a request runs alone (see ModelStreams.reclaim)."""


@dataclass(slots=True)
class InFlight:
    batch: Batch
    held: list[Held]
    batch_id: str
    started_at: float = 0.0
    """When the device thread began it (a queued batch waits for the one before)."""
    finished_at: float = 0.0
    outcome: BatchOutcome | None = None


class BatchLoop:
    """Serves one model from its lane streams until stopped (or, in burst mode, until idle)."""

    def __init__(
        self,
        model: str,
        config: ModelConfig,
        handler: Handler,
        client: redis.Redis,
        *,
        consumer: str,
        worker: WorkerConfig | None = None,
        burst: bool = False,
        clock: Callable[[], float] | None = None,
        observers: Sequence[LoopObserver] = (),
    ) -> None:
        self.model = model
        self.config = config
        self.handler = handler
        self.worker = worker or WorkerConfig()
        self.consumer = consumer
        self.burst = burst
        self.streams = ModelStreams(client, model, config.lanes, consumer)
        self.engine = Engine(config.batch.policy(config.lanes))
        self.stats = LoopStats(model=model, lanes=config.lanes)
        self.observers = Observers([self.stats, *observers])
        self.answers = Answerer(
            model, config, self.worker, consumer, self.streams, self.observers, self.stats
        )
        self._clock = clock
        self._held: dict[str, Held] = {}
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._last_reclaim = 0.0
        self._reclaiming = False
        self._running_suspect = False
        self._now: Callable[[], float] = time.time
        self._unpublished: deque[InFlight] = deque()
        """Computed batches whose results could not be stored yet (Redis away)."""
        self._computed: deque[InFlight] = deque()
        """Finished on the device, not yet learnt from (loop thread)."""
        self._storing: set[str] = set()
        """Batches handed to the publisher thread and not stored yet (their ids)."""
        self._inflight: deque[InFlight] = deque()
        """Dispatched and not yet computed: the running batch, and at most one queued."""
        self._wake = threading.Event()
        """Set by the device thread when a batch finishes, to wake a waiting loop."""
        self._last_heartbeat = 0.0
        self._idle_reads = 0
        self._paused = False
        self._draining = False
        self._device = ThreadPoolExecutor(1, thread_name_prefix=f"device-{model}")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix=f"publish-{model}")

    # --- control ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop reading; the running batch finishes and is published before ``run`` returns."""
        self._stop.set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def reset(self) -> None:
        """Forget held requests after a crash (they stay pending in Redis and are reclaimed)."""
        self._held.clear()
        self._inflight.clear()
        self._computed.clear()
        self._storing.clear()
        self._stopped.clear()
        self._device = ThreadPoolExecutor(1, thread_name_prefix=f"device-{self.model}")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix=f"publish-{self.model}")

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def pause(self) -> None:
        """Stop reading new entries; what this worker already holds is still answered."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def drain(self) -> None:
        """Stop reading, answer everything held, then stop (``run`` returns)."""
        self._draining = True

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def held(self) -> int:
        """Requests read and not yet dispatched (the running batch not included)."""
        return len(self._held)

    def set_policy(self, policy: Policy) -> None:
        """Change the batch policy live; the engine keeps what it learnt."""
        self.engine.set_policy(policy)

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        finally:
            self._device.shutdown(wait=True)
            self._publisher.shutdown(wait=True)
            self._stopped.set()

    def _run(self) -> None:
        self.streams.ensure_groups(self.config.max_queue_depth)
        clock = self._clock or RedisClock(self.streams)
        self._now = clock
        backoff = 0.05
        logger.info("batch loop for %s started as %s", self.model, self.consumer)
        while True:
            try:
                self._step(clock)
                backoff = 0.05
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                logger.warning("redis unreachable (%s); retrying in %.2fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if self._busy():
                continue
            if self._stop.is_set() or self._burst_done() or self._drained():
                break
        if self._held:
            with contextlib.suppress(redis.RedisError):
                self.streams.release(
                    [h.entry for h in self._held.values()], self.worker.claim_idle_ms
                )
                logger.info(
                    "released %d unstarted requests of %s to the fleet", len(self._held), self.model
                )
            self._held.clear()
        with contextlib.suppress(redis.RedisError):
            self.streams.unregister()
        logger.info("batch loop for %s stopped", self.model)

    def _busy(self) -> bool:
        """Batches dispatched whose results are not stored yet."""
        return bool(self._inflight or self._computed or self._storing or self._unpublished)

    def _burst_done(self) -> bool:
        return self.burst and not self._held and self._idle_reads >= 2

    def _drained(self) -> bool:
        return self._draining and not self._held

    def _step(self, clock: Callable[[], float]) -> None:
        self._wake.clear()
        now = clock()
        while self._computed:
            self._learn(self._computed.popleft())
        while self._unpublished:  # kept until stored, so a Redis outage loses no result
            self._store(self._unpublished[0])
            self._unpublished.popleft()

        running = len(self._inflight)
        due = self._due() if running else None
        expected = None if not running else max(now, due or now)
        # Results must go out as fast as batches come in: with a second finished batch
        # still waiting for the publisher, hold the next one (it grows meanwhile).
        behind = len(self._storing) > 1
        suspect = self._suspect()
        # Queue the next batch behind the running one only when that one is due to end
        # within PREQUEUE_S. Past its predicted end, when it ends is unknown: wait for it,
        # so the next batch is not formed early from whatever has arrived.
        can_queue = running == 1 and (
            not self._inflight or (due is not None and abs(due - now) <= PREQUEUE_S)
        )
        if behind:
            plan = self.engine.plan(self._waiting(), now, max(expected or now, now + POLL_S))
        elif running == 0 and suspect is not None:
            plan = Plan(batch=Batch((suspect,), "retry"))
        elif running == 0 or (can_queue and suspect is None and not self._running_suspect):
            plan = self.engine.plan(self._waiting(), now, None)
        else:
            plan = self.engine.plan(self._waiting(), now, expected)
        if plan.expired:
            self._expire(plan.expired, clock())
        if plan.batch is not None and not self._stop.is_set():
            self._dispatch(plan.batch, clock())

        if self._stop.is_set():
            if self._inflight or self._computed or self._storing:
                self._wake.wait(0.05)
            return

        now = clock()
        wake_at = plan.wake_at
        if len(self._inflight) == 1 and self._held:
            due = self._due()  # wake in time to queue the next batch behind it
            if due is not None and due - PREQUEUE_S > now:
                wake_at = min(wake_at or math.inf, due - PREQUEUE_S)
        if self._paused or self._draining:
            self._idle(now, wake_at)
            return
        # Read more, blocking only as long as nothing else needs doing.
        budget = self.engine.read_budget(len(self._held))
        if budget <= 0:  # holding enough: wake when the device frees up or a timer is due
            self._heartbeat(now)
            self._wake.wait(max(0.0005, min((wake_at or now + 0.05) - now, 0.05)))
            return
        if self._inflight and self._held:
            # Work waits for the device: never sit in a Redis BLOCK, which the device's end
            # cannot interrupt. Top up, then wait for the device, a timer, or the next poll.
            self._read(budget, None, now)
            left = ACTIVE_POLL_S if wake_at is None else wake_at - clock()
            self._wake.wait(max(0.0, min(left, ACTIVE_POLL_S)))
            return
        if wake_at is not None and wake_at - now < SHORT_WAIT_S:
            self._read(budget, None, now)  # a BLOCK this short could return up to 100 ms late
            if wake_at > clock():
                self._wake.wait(POLL_S)
            return
        if wake_at is not None:
            wait_ms = (wake_at - now - SHORT_WAIT_S) * 1000
            block_ms = int(max(1.0, min(wait_ms, self.worker.block_ms)))
        else:
            block_ms = self.worker.block_ms
        self._read(budget, block_ms, now)

    def _due(self) -> float | None:
        """When the running batch should end by the cost model (None: none has started)."""
        try:
            first = self._inflight[0]  # the device thread may pop it meanwhile
        except IndexError:
            return None
        if not first.started_at:
            return None
        return first.started_at + self.engine.estimate(first.batch.rows, first.batch.padded_tokens)

    def _idle(self, now: float, wake_at: float | None) -> None:
        """Paused or draining: keep the heartbeat, wait for the device or the next wake-up."""
        self._heartbeat(now)
        self._wake.wait(max(0.0005, min((wake_at or now + 0.05) - now, 0.05)))

    def _waiting(self) -> list[Waiting]:
        return [h.waiting for h in self._held.values() if h.entry.deliveries < SUSPECT]

    def _suspect(self) -> Waiting | None:
        """A request whose last two holders died (one may have died of it): it runs alone."""
        return next((h.waiting for h in self._held.values() if h.entry.deliveries >= SUSPECT), None)

    # --- reading ----------------------------------------------------------------------------

    def _heartbeat(self, now: float) -> None:
        if now - self._last_heartbeat > HEARTBEAT_EVERY_S:
            self._last_heartbeat = now
            self.streams.heartbeat(int(now * 1000))

    def _read(self, budget: int, block_ms: int | None, now: float) -> None:
        self._heartbeat(now)
        holds_suspect = self._running_suspect or self._suspect() is not None
        if now - self._last_reclaim > RECLAIM_EVERY_S or (self._reclaiming and not holds_suspect):
            self._last_reclaim = now
            found = self.streams.reclaim(
                self.worker.claim_idle_ms, budget, suspects=not holds_suspect
            )
            self._reclaiming = bool(found)
            self._admit(found, now)
        lanes = range(self.config.lanes)
        entries = self.streams.read(split_budget(budget, lanes, self.engine.policy), block_ms)
        self._idle_reads = 0 if entries else self._idle_reads + 1
        # After a blocking read, "read at" is when it returned, not when it started.
        self._admit(entries, self._now() if block_ms else now)

    def _admit(self, entries: Sequence[Entry], now: float) -> None:
        """Decode, validate and tokenize new entries; answer the bad ones at once."""
        if not entries:
            return
        limits = self.config.limits
        fresh: list[tuple[Entry, Request, Format]] = []
        for entry in entries:
            try:
                request, fmt = decode_entry(entry.fields, self.model, limits)
            except EntryRejected as exc:
                self.answers.reject(entry, exc, now)
                continue
            fresh.append((entry, request, fmt))
        redelivered = [i for i, (e, _, _) in enumerate(fresh) if e.deliveries > 1]
        if redelivered:
            done = self.streams.existing_results([fresh[i][1].id for i in redelivered])
            already = {redelivered[j] for j, d in enumerate(done) if d}
            if already:
                self.streams.ack_only([fresh[i][0] for i in already])
                fresh = [f for i, f in enumerate(fresh) if i not in already]
        poison = [f for f in fresh if f[0].deliveries > self.worker.max_deliveries]
        for entry, _, _ in poison:
            self._poisoned(entry, now)
        if poison:
            fresh = [f for f in fresh if f[0].deliveries <= self.worker.max_deliveries]
        texts = [t for _, req, _ in fresh for t in req.inputs]
        try:
            encoded = self.handler.encode(texts) if texts else []
        except Exception:
            encoded = []
        pos = 0
        for entry, request, fmt in fresh:
            if encoded:
                rows = encoded[pos : pos + len(request.inputs)]
                pos += len(request.inputs)
            else:
                try:
                    rows = self.handler.encode(request.inputs)
                except Exception as exc:
                    self.answers.error(
                        entry,
                        request,
                        fmt,
                        ErrorCode.INVALID_REQUEST,
                        f"cannot tokenize: {exc}",
                        now,
                    )
                    continue
            enq = entry.enqueued_ms / 1000
            deadline = None if request.deadline_ms is None else enq + request.deadline_ms / 1000
            waiting = Waiting(
                key=entry.key,
                lane=entry.lane,
                arrived=enq,
                tokens=max(r.tokens for r in rows),
                size=len(rows),
                deadline=deadline,
            )
            self._held[entry.key] = Held(entry, request, fmt, list(rows), waiting, now)
            self.stats.received(entry.lane)

    def _poisoned(self, entry: Entry, now: float) -> None:
        """Delivered too often without an answer: dead-letter it and tell its requester."""
        reason = (
            f"delivered {entry.deliveries} times without an answer (max_deliveries "
            f"{self.worker.max_deliveries}): it keeps failing or crashing workers"
        )
        env = envelope_of(entry.fields, self.config.limits)
        self.answers.reject(entry, EntryRejected(reason, ErrorCode.POISONED, env), now, dead=True)

    # --- computing --------------------------------------------------------------------------

    def _dispatch(self, batch: Batch, now: float) -> None:
        held = [self._held.pop(w.key) for w in batch.items]
        batch_id = uuid.uuid4().hex[:12]
        logger.debug(
            "batch %s of %s: %d requests, %d rows, %d padded tokens, reason %s",
            batch_id, self.model, len(held), batch.rows, batch.padded_tokens, batch.reason,
        )  # fmt: skip
        self._running_suspect = batch.reason == "retry"
        inflight = InFlight(batch, held, batch_id)
        self._inflight.append(inflight)
        self._device.submit(self._compute, inflight)
        self.observers.on_dispatch(self.model, batch, batch_id, now)

    def _compute(self, inflight: InFlight) -> None:
        """Device thread: run the batch, publish its results, wake the loop.

        When nothing is queued behind it and the publisher is idle (light load), this
        thread publishes them itself: one thread hand-off less on the latency path.
        Otherwise the publisher thread does, and the next batch starts at once."""
        inflight.started_at = self._now()
        try:
            inflight.outcome = run_batch(self.handler, [h.rows for h in inflight.held])
        except BaseException as exc:  # run_batch isolates handler errors; this is a bug
            logger.exception("batch %s of %s crashed", inflight.batch_id, self.model)
            failure = Failure(f"{type(exc).__name__}: {exc}")
            inflight.outcome = BatchOutcome([failure] * len(inflight.held))
        inflight.finished_at = self._now()
        inline = len(self._inflight) == 1 and not self._storing
        self._storing.add(inflight.batch_id)
        if inline:  # before the loop is woken: it would compete for the GIL meanwhile
            self._publish(inflight)
        else:
            self._publisher.submit(self._publish, inflight)
        self._inflight.popleft()
        self._computed.append(inflight)
        self._wake.set()

    def _learn(self, inflight: InFlight) -> None:
        """Loop thread: teach the engine the measured batch time."""
        outcome = inflight.outcome
        assert outcome is not None
        if inflight.batch.reason == "retry":
            self._running_suspect = False
        if outcome.out_of_memory:
            self.engine.out_of_memory(inflight.batch, inflight.finished_at)
        elif outcome.calls == 1:
            self.engine.observe(inflight.batch, inflight.finished_at - inflight.started_at)

    def _publish(self, inflight: InFlight) -> None:
        """Publisher thread: tell the observers, then store, publish and ack the results."""
        outcome = inflight.outcome
        assert outcome is not None
        seconds = max(0.0, inflight.finished_at - inflight.started_at)
        failed = sum(isinstance(o, Failure) for o in outcome.outcomes)
        self.observers.on_batch_done(
            self.model, inflight.batch, inflight.batch_id, seconds, outcome.out_of_memory, failed
        )
        try:
            self._store(inflight)
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # the loop retries
            logger.warning("results of batch %s not stored yet: %s", inflight.batch_id, exc)
            self._unpublished.append(inflight)
        except Exception:  # never stored nor acked: redelivered, then dead-lettered if it recurs
            logger.exception("results of batch %s of %s failed", inflight.batch_id, self.model)
        finally:
            self._storing.discard(inflight.batch_id)
            self._wake.set()

    def _store(self, inflight: InFlight) -> None:
        outcome = inflight.outcome
        assert outcome is not None
        run = BatchRun(
            inflight.batch_id, inflight.batch.rows, inflight.started_at, inflight.finished_at
        )
        self.answers.computed(run, list(zip(inflight.held, outcome.outcomes, strict=True)))

    def _expire(self, expired: Sequence[Waiting], now: float) -> None:
        helds = [h for w in expired if (h := self._held.pop(w.key, None)) is not None]
        self.answers.expired(helds, now)
