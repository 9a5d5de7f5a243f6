"""The batch loop of one model: read → plan → infer → publish → ack.

It runs on its own thread inside the Celery worker process. Inference runs on a
second, "device" thread, so while batch k computes the loop already reads,
decodes and tokenizes what batch k+1 will hold, and publishes batch k-1's results
after batch k has been started.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
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
SUSPECT = 3
"""Deliveries from which a request runs alone (see ModelStreams.reclaim)."""


@dataclass(slots=True)
class InFlight:
    batch: Batch
    held: list[Held]
    future: Future[BatchOutcome]
    dispatched_at: float
    batch_id: str


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
        self._unpublished: list[tuple[InFlight, BatchOutcome]] = []
        self._last_heartbeat = 0.0
        self._idle_reads = 0
        self._paused = False
        self._draining = False
        self._device = ThreadPoolExecutor(1, thread_name_prefix=f"device-{model}")

    # --- control ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop reading; the running batch finishes and is published before ``run`` returns."""
        self._stop.set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def reset(self) -> None:
        """Forget held requests after a crash (they stay pending in Redis and are reclaimed)."""
        self._held.clear()
        self._stopped.clear()
        self._device = ThreadPoolExecutor(1, thread_name_prefix=f"device-{self.model}")

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
            self._stopped.set()

    def _run(self) -> None:
        self.streams.ensure_groups(self.config.max_queue_depth)
        clock = self._clock or RedisClock(self.streams)
        self._now = clock
        inflight: InFlight | None = None
        backoff = 0.05
        logger.info("batch loop for %s started as %s", self.model, self.consumer)
        while True:
            try:
                inflight = self._step(clock, inflight)
                backoff = 0.05
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                logger.warning("redis unreachable (%s); retrying in %.2fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if inflight is None and (self._stop.is_set() or self._burst_done() or self._drained()):
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

    def _burst_done(self) -> bool:
        return self.burst and not self._held and self._idle_reads >= 2

    def _drained(self) -> bool:
        return self._draining and not self._held

    def _step(self, clock: Callable[[], float], inflight: InFlight | None) -> InFlight | None:
        now = clock()
        if inflight is not None and inflight.future.done():
            self._unpublished.append((inflight, inflight.future.result()))
            self._learn(*self._unpublished[-1], now)
            inflight = None

        suspect = self._suspect()
        if inflight is None and suspect is not None:
            plan = Plan(batch=Batch((suspect,), "retry"))
        elif inflight is None:
            plan = self.engine.plan(self._waiting(), now, None)
        else:
            expected = inflight.dispatched_at + self.engine.estimate(
                inflight.batch.rows, inflight.batch.padded_tokens
            )
            plan = self.engine.plan(self._waiting(), now, max(expected, now))
        if plan.expired:
            self._expire(plan.expired, clock())
        if inflight is None and plan.batch is not None and not self._stop.is_set():
            inflight = self._dispatch(plan.batch, clock())
        while self._unpublished:  # kept until stored, so a Redis outage loses no result
            self._publish(*self._unpublished[0], clock())
            self._unpublished.pop(0)

        if self._stop.is_set():
            if inflight is not None:
                wait_futures([inflight.future])
            return inflight

        now = clock()
        if self._paused or self._draining:
            self._idle(now, inflight, plan.wake_at)
            return inflight
        # Read more, blocking only as long as nothing else needs doing.
        budget = self.engine.read_budget(len(self._held))
        if inflight is not None:
            if budget > 0:  # top up while the device works, polling for its end
                self._read(budget, None, now)
                wait_futures([inflight.future], timeout=0.002)
            else:  # holding enough: just wake the moment the device is done
                until = plan.wake_at or now + 0.05
                wait_futures([inflight.future], timeout=min(0.05, max(0.0005, until - now)))
            return inflight
        if budget <= 0:
            time.sleep(max(0.0005, min((plan.wake_at or now + 0.005) - now, 0.05)))
            return None
        if plan.wake_at is not None and plan.wake_at - now < SHORT_WAIT_S:
            self._read(budget, None, now)  # a BLOCK this short could return up to 100 ms late
            time.sleep(max(0.0, min(plan.wake_at - now, POLL_S)))
            return inflight
        if plan.wake_at is not None:
            wait_ms = (plan.wake_at - now - SHORT_WAIT_S) * 1000
            block_ms = int(max(1.0, min(wait_ms, self.worker.block_ms)))
        elif plan.batch is not None:
            block_ms = None  # device busy from now on: just top up
        else:
            block_ms = self.worker.block_ms
        self._read(budget, block_ms, now)
        return inflight

    def _idle(self, now: float, inflight: InFlight | None, wake_at: float | None) -> None:
        """Paused or draining: keep the heartbeat, wait for the device or the next wake-up."""
        self._heartbeat(now)
        if inflight is not None:
            wait_futures([inflight.future], timeout=0.01)
        else:
            time.sleep(max(0.0005, min((wake_at or now + 0.05) - now, 0.05)))

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

    def _dispatch(self, batch: Batch, now: float) -> InFlight:
        held = [self._held.pop(w.key) for w in batch.items]
        future = self._device.submit(run_batch, self.handler, [h.rows for h in held])
        batch_id = uuid.uuid4().hex[:12]
        logger.debug(
            "batch %s of %s: %d requests, %d rows, %d padded tokens, reason %s",
            batch_id, self.model, len(held), batch.rows, batch.padded_tokens, batch.reason,
        )  # fmt: skip
        self._running_suspect = batch.reason == "retry"
        self.observers.on_dispatch(self.model, batch, batch_id, now)
        return InFlight(batch, held, future, now, batch_id)

    def _learn(self, inflight: InFlight, outcome: BatchOutcome, now: float) -> None:
        self._running_suspect = False
        seconds = max(0.0, now - inflight.dispatched_at)
        if outcome.out_of_memory:
            self.engine.out_of_memory(inflight.batch, now)
        elif outcome.calls == 1:
            self.engine.observe(inflight.batch, seconds)
        failed = sum(isinstance(o, Failure) for o in outcome.outcomes)
        self.observers.on_batch_done(
            self.model, inflight.batch, inflight.batch_id, seconds, outcome.out_of_memory, failed
        )

    def _publish(self, inflight: InFlight, outcome: BatchOutcome, now: float) -> None:
        run = BatchRun(inflight.batch_id, inflight.batch.rows, inflight.dispatched_at, now)
        self.answers.computed(run, list(zip(inflight.held, outcome.outcomes, strict=True)))

    def _expire(self, expired: Sequence[Waiting], now: float) -> None:
        helds = [h for w in expired if (h := self._held.pop(w.key, None)) is not None]
        self.answers.expired(helds, now)
