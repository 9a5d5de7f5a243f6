"""Answering requests: build each result, then store, publish and ack it in one round trip.

The batch loop decides *what* happens to a request; this module turns that into the
``Result`` on the wire (timings included) and tells the observers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..batching.types import Waiting
from ..config import ModelConfig, WorkerConfig
from ..schemas.codec import EntryRejected, encode_result
from ..schemas.errors import ErrorCode
from ..schemas.messages import ErrorInfo, Format, Request, Result, Status, Timings
from .handlers.base import Encoded
from .inference import Failure
from .observers import Answered, Observers
from .stats import LoopStats
from .streams import Entry, Finish, ModelStreams

logger = logging.getLogger(__name__)

EXPIRED = ErrorInfo(
    code=ErrorCode.DEADLINE_EXCEEDED, message="deadline cannot be met; not computed"
)


@dataclass(slots=True)
class Held:
    """A valid request a worker has read and not yet answered."""

    entry: Entry
    request: Request
    fmt: Format
    rows: list[Encoded]
    waiting: Waiting
    read_at: float


@dataclass(frozen=True, slots=True)
class BatchRun:
    """Where a computed batch's time went, for its members' timings."""

    batch_id: str
    rows: int
    dispatched_at: float
    finished_at: float


class Answerer:
    """Writes one model's results as one consumer."""

    def __init__(
        self,
        model: str,
        config: ModelConfig,
        worker: WorkerConfig,
        consumer: str,
        streams: ModelStreams,
        observers: Observers,
        stats: LoopStats,
    ) -> None:
        self.model = model
        self.config = config
        self.worker = worker
        self.consumer = consumer
        self.streams = streams
        self.observers = observers
        self.stats = stats
        self._lock = threading.Lock()

    def computed(self, run: BatchRun, members: Sequence[tuple[Held, list[Any] | Failure]]) -> None:
        """Results of a finished batch: outputs, or ``inference_failed`` for a failure."""
        run_ms = (run.finished_at - run.dispatched_at) * 1000
        answers = []
        for held, out in members:
            timings = self.timings(held.entry, held.read_at, run.dispatched_at, run.finished_at,
                                   run_ms, run.rows, run.batch_id)  # fmt: skip
            req = held.request
            if isinstance(out, Failure):
                error = ErrorInfo(code=ErrorCode.INFERENCE_FAILED, message=out.message)
                result = self.result(req.id, "error", req.metadata, timings, error=error)
            else:
                result = self.result(req.id, "ok", req.metadata, timings, outputs=out,
                                     truncated=[r.truncated for r in held.rows])  # fmt: skip
            answers.append(self._answer(held.entry, req, held.fmt, result))
        self.store(answers)

    def expired(self, helds: Sequence[Held], now: float) -> None:
        """``expired`` results for requests whose deadline cannot be met (never computed)."""
        answers = []
        for held in helds:
            timings = self.timings(held.entry, held.read_at, now, now)
            result = self.result(
                held.request.id, "expired", held.request.metadata, timings, error=EXPIRED
            )
            answers.append(self._answer(held.entry, held.request, held.fmt, result))
        self.store(answers)

    def error(
        self, entry: Entry, request: Request, fmt: Format, code: ErrorCode, message: str, now: float
    ) -> None:
        """An ``error`` result for a valid request that cannot be computed."""
        result = self.result(request.id, "error", request.metadata,
                             self.timings(entry, now, now, now), error=ErrorInfo(code=code, message=message))  # fmt: skip
        self.store([self._answer(entry, request, fmt, result)])

    def reject(self, entry: Entry, exc: EntryRejected, now: float, dead: bool = False) -> None:
        """Answer an entry that will not be computed; dead-letter it if nobody can be
        answered (or ``dead``: it is poison and operators should see it)."""
        env = exc.envelope
        self.stats.rejected(exc.code.value)
        if dead or env.id is None:
            dead_id = self.streams.dead_letter(
                entry, exc.code.value, str(exc), self.consumer, self.worker.dead_letter_maxlen
            )
            self.observers.on_dead_letter(self.model, entry.lane, exc.code.value, str(exc))
            logger.warning(
                "entry %s of %s dead-lettered as %s: %s", entry.id, self.model, dead_id, exc
            )
        if env.id is None:
            return
        logger.info("request %s of %s rejected: %s", env.id, self.model, exc)
        result = self.result(env.id, "error", env.metadata, self.timings(entry, now, now, now),
                             error=ErrorInfo(code=exc.code, message=str(exc)))  # fmt: skip
        finish = Finish(
            entry, env.id, encode_result(result, env.format), self.config.result_ttl_s, env.reply
        )
        self.store([(finish, Answered(entry.lane, None, result, True))])

    def store(self, answers: Sequence[tuple[Finish, Answered]]) -> None:
        """Store, publish and ack results in one round trip, then tell the observers."""
        if not answers:
            return
        with self._lock:  # the publisher thread and the loop thread both answer
            self._store(answers)

    def _store(self, answers: Sequence[tuple[Finish, Answered]]) -> None:
        stored = self.streams.finish([f for f, _ in answers])
        self.observers.on_answered(
            self.model,
            [
                a if s else replace(a, stored=False)
                for (_, a), s in zip(answers, stored, strict=True)
            ],
        )

    def result(
        self,
        request_id: str,
        status: Status,
        metadata: dict[str, str],
        timings: Timings,
        **rest: Any,
    ) -> Result:
        # Every field is built here from checked values: skip validation (hot path).
        return Result.model_construct(
            id=request_id, model=self.model, status=status, metadata=metadata, timings=timings,
            finished_at_ms=int(time.time() * 1000), **rest,
        )  # fmt: skip

    def _answer(
        self, entry: Entry, request: Request, fmt: Format, result: Result
    ) -> tuple[Finish, Answered]:
        ttl = min(
            request.result_ttl_s or self.config.result_ttl_s, self.config.limits.max_result_ttl_s
        )
        try:
            payload = encode_result(result, fmt)
        except Exception as exc:  # a handler returned outputs the wire cannot carry
            logger.warning("result of %s cannot be encoded: %s", request.id, exc)
            message = f"handler output cannot be encoded: {type(exc).__name__}: {exc}"
            error = ErrorInfo(code=ErrorCode.INFERENCE_FAILED, message=message)
            result = result.model_copy(update={"status": "error", "outputs": None,
                                               "truncated": None, "error": error})  # fmt: skip
            payload = encode_result(result, fmt)
        finish = Finish(entry, request.id, payload, ttl, request.reply)
        return finish, Answered(entry.lane, request, result, True)

    def timings(
        self,
        entry: Entry,
        read_at: float,
        dispatched_at: float,
        now: float,
        run_ms: float = 0.0,
        rows: int = 0,
        batch_id: str = "",
    ) -> Timings:
        """Milliseconds on the Redis clock: enqueue (the entry id's time) → read → dispatch → now."""
        enq = entry.enqueued_ms / 1000
        return Timings(
            queued_ms=round(max(0.0, read_at - enq) * 1000, 3),
            batch_wait_ms=round(max(0.0, dispatched_at - read_at) * 1000, 3),
            inference_ms=round(run_ms, 3),
            total_ms=round(max(0.0, now - enq) * 1000, 3),
            batch_size=rows,
            batch_id=batch_id,
            worker=self.consumer,
        )
