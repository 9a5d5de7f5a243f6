"""Result sinks: everything that leaves a worker about its requests goes through one.

:class:`RedisSink` stores, publishes and acks final results with ``finish.lua`` (one
script call per batch), appends partial results to a per-request stream, and writes dead
letters, on a writer thread of its own, in order; a Redis outage holds the queue until
Redis is back, so no computed result is lost. :class:`MemorySink` keeps everything in
memory, for tests and simulations. Both tell the observers once results are stored and
wake the loop, which holds new batches while results pile up (``backlog``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import redis

from ..redis_errors import UNREACHABLE, refused_for_now
from ..schemas.codec import delta_fields, encode_delta, end_fields
from .answers import Outgoing
from .observers import Answered, DeadLettered, Observers
from .streamed import Streamed
from .streams import STORED, SUPERSEDED, Entry, ModelStreams, Retiring
from .token_stream import TokenWrite
from .token_writes import Sent, TokenWrites

logger = logging.getLogger(__name__)


class ResultSink(Protocol):
    @property
    def backlog(self) -> int:
        """Batches of results handed over and not stored yet."""
        ...

    def start(self) -> None: ...

    def send(self, answers: Sequence[Outgoing]) -> None:
        """Store, publish and ack these results (asynchronously, in order)."""
        ...

    def stream(self, items: Sequence[Streamed]) -> None:
        """Append deltas (or ends) to requests' token streams and publish the deltas on
        their reply channels (generating runners), in order with results."""
        ...

    def stream_now(self, items: Sequence[Streamed]) -> None:
        """Deltas, sent on the calling thread at once when no token write waits for the
        writer thread (else, or if sending fails, queued like :meth:`stream`). Redis's
        answer is not waited for: the writer thread is woken to read it, and it is read
        by whichever needs it first, the next ``stream_now`` (before it sends) or the
        writer thread (before its next write, so nothing handed over later overtakes these
        deltas); on a failure the deltas are queued again, ahead of any later write."""
        ...

    def started(self, items: Sequence[tuple[str, int]]) -> None:
        """Requests admitted (their prefill begins), (id, TTL in seconds) each: marked
        started in Redis (:meth:`~.streams.ModelStreams.mark_started`), in order."""
        ...

    def dead_letter(self, entry: Entry, code: str, reason: str) -> None:
        """Move an entry to the dead-letter stream (it is acked there)."""
        ...

    def retire(self, items: Sequence[Retiring]) -> None:
        """Ack redelivered entries whose result is stored, publishing it on their reply
        channel (they are not computed again)."""
        ...

    def close(self, timeout: float | None = None) -> None:
        """Store everything handed over (up to ``timeout``), then stop."""
        ...


@dataclass(frozen=True, slots=True)
class _Finish:
    answers: Sequence[Outgoing]


@dataclass(frozen=True, slots=True)
class _Tokens:
    items: Sequence[Streamed]


@dataclass(frozen=True, slots=True)
class _Started:
    items: Sequence[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class _Dead:
    entry: Entry
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Retire:
    items: Sequence[Retiring]


_Job = _Finish | _Tokens | _Started | _Dead | _Retire


TRANSIENT = (
    *UNREACHABLE,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
)
"""Errors of a Redis that cannot write for now (out of memory under noeviction, a replica
during failover, loading...; ``NOREPLICAS``: ``refused_for_now``): retried like a lost
connection, never dropping a result."""
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0
"""Such a write is tried again this long after, doubling (until :meth:`RedisSink.close`
gives up on it)."""


def _transient(exc: Exception) -> bool:
    if refused_for_now(exc):  # (NOREPLICAS has no class of its own)
        return True
    return isinstance(exc, TRANSIENT) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith(("BUSY", "OOM", "LOADING"))
    )


class RedisSink:
    """Writes one model's results to Redis on a writer thread."""

    def __init__(
        self,
        streams: ModelStreams,
        observers: Observers,
        wake: Callable[[], None],
        *,
        dead_letter_maxlen: int,
        release_idle_ms: int = 300_000,
        settled: Callable[[Sequence[Entry]], None] | None = None,
        name: str = "sink",
    ) -> None:
        self.streams = streams
        self._settled = settled
        """Told the entries acked (answered, retired, dead-lettered): a later look for lost
        deliveries takes them again if Redis lost the ack (a failover)."""
        self.observers = observers
        self._wake = wake
        self._dead_maxlen = dead_letter_maxlen
        self._release_idle_ms = release_idle_ms
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._backlog = 0
        self._tokens_queued = 0
        """Token writes handed to the writer thread and not done (see ``stream_now``)."""
        self._direct = TokenWrites(streams)
        """``stream_now``'s writes (the device thread's)."""
        self._direct_lock = threading.Lock()
        """Held to send at once or to read the answer: one thread at a time, every answer
        read before the next send (see :meth:`settle`)."""
        self._unread: tuple[Sent, Sequence[Streamed]] | None = None
        """Deltas sent at once whose answer is not read yet."""
        self._unanswered: list[Sequence[Streamed]] = []
        """Deltas sent at once whose write failed: the writer thread writes them first."""
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def backlog(self) -> int:
        return self._backlog

    def start(self) -> None:
        self._thread.start()

    def send(self, answers: Sequence[Outgoing]) -> None:
        if answers:
            with self._lock:
                self._backlog += 1
            self._queue.put(_Finish(answers))

    def stream(self, items: Sequence[Streamed]) -> None:
        if items:
            with self._lock:
                self._tokens_queued += 1
            self._queue.put(_Tokens(items))

    def started(self, items: Sequence[tuple[str, int]]) -> None:
        if items:
            self._queue.put(_Started(items))

    def stream_now(self, items: Sequence[Streamed]) -> None:
        if not items:
            return
        with self._direct_lock:
            self._settle()  # the last call's answer first (it may queue its deltas again)
            with self._lock:
                direct = self._tokens_queued == 0  # nothing of theirs to overtake
            if direct:
                try:
                    self._unread = (self._direct.send(items), items)
                except Exception as exc:  # the writer thread retries it, in order
                    logger.warning("writing %d deltas failed (%s): queued", len(items), exc)
                else:
                    self._queue.put(_Tokens(()))  # the writer thread reads the answer
                    return
        self.stream(items)

    def settle(self) -> None:
        """Read Redis's answer to the deltas last sent at once, if nobody has: the device
        thread does not wait for it, so it steps on while Redis runs the call."""
        with self._direct_lock:
            self._settle()

    def _settle(self) -> None:
        unread, self._unread = self._unread, None
        if unread is None:
            return
        sent, items = unread
        try:
            self._direct.receive(sent)
        except Exception as exc:  # written again by the writer thread, before any later job
            logger.warning("writing %d deltas failed (%s): queued", len(items), exc)
            with self._lock:
                self._tokens_queued += 1
                self._unanswered.append(items)
            self._queue.put(_Tokens(()))  # wakes the writer thread

    def dead_letter(self, entry: Entry, code: str, reason: str) -> None:
        self._queue.put(_Dead(entry, code, reason))

    def retire(self, items: Sequence[Retiring]) -> None:
        self._queue.put(_Retire(items))

    def close(self, timeout: float | None = None) -> None:
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._closing.set()  # a writer still retrying against a dead Redis gives up
        if self._thread.is_alive():
            self._thread.join(1.0)
        if not self._thread.is_alive():  # an answer left unread is never left to the pool
            self.settle()
        self._direct.close()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            self.settle()  # deltas sent at once come before this job: their answer first
            with self._lock:
                again, self._unanswered = self._unanswered, []
            for items in again:
                self._write(_Tokens(items))
            if isinstance(job, _Tokens) and not job.items:
                continue  # a wake-up: deltas sent at once, or failed (read, written above)
            self._write(job)

    def _write(self, job: _Job) -> None:
        try:
            self._write_once(job)
        finally:
            if isinstance(job, _Tokens):
                with self._lock:
                    self._tokens_queued -= 1

    def _write_once(self, job: _Job) -> None:
        backoff = RETRY_FIRST_S
        while True:
            try:
                self._do(job)
                return
            except Exception as exc:
                if not _transient(exc):
                    self._failed(job, exc)
                    return
                if self._closing.is_set():
                    logger.error("Redis unavailable at shutdown: %s not written (%s)", job, exc)
                    self._done(job)
                    return
                # Kept until written, in order, so a Redis outage loses no result.
                logger.warning("redis cannot write (%s); retrying in %.2fs", exc, backoff)
                self._closing.wait(backoff)  # (close ends the wait: one last try, then done)
                backoff = min(backoff * 2, RETRY_MAX_S)

    def _failed(self, job: _Job, exc: Exception) -> None:
        """A write Redis refuses for good: hand the entries back (their delivery counted),
        so another try, or max_deliveries, answers them rather than nobody."""
        logger.exception("writing %s failed: %s", type(job).__name__, exc)
        entries = [a.entry for a in job.answers] if isinstance(job, _Finish) else []
        if isinstance(job, _Dead):
            entries = [job.entry]
        try:
            if entries:
                self.streams.release(entries, self._release_idle_ms, counted=True)
        except Exception:
            logger.exception("handing back %d entries failed", len(entries))
        self._done(job)

    def _do(self, job: _Job) -> None:
        if isinstance(job, _Finish):
            encoded = [a.encode() for a in job.answers]
            stored = self.streams.finish([f for f, _ in encoded])
            self._done(job)
            # (a superseded attempt is not acked: its entry stays the new owner's)
            acked = zip(job.answers, stored, strict=True)
            self._settle_entries([a.entry for a, s in acked if s != SUPERSEDED])
            replies = []
            for (_, reply), s in zip(encoded, stored, strict=True):
                if s == SUPERSEDED:
                    logger.info("request %s: not answered, another worker has taken it over",
                                reply.result.id)  # fmt: skip
                else:
                    replies.append(reply if s == STORED else replace(reply, stored=False))
            self.observers.notify(Answered(self.streams.keys.model, replies))
        elif isinstance(job, _Tokens):
            self.streams.append_tokens([checked(it.write()) for it in job.items])
        elif isinstance(job, _Started):
            self.streams.mark_started(job.items)
        elif isinstance(job, _Retire):
            self.streams.retire(job.items)
            self._settle_entries([it.entry for it in job.items])
        else:
            dead_id = self.streams.dead_letter(
                job.entry, job.code, job.reason, self.streams.consumer, self._dead_maxlen
            )
            logger.warning("entry %s dead-lettered as %s: %s", job.entry.id, dead_id, job.reason)
            self._settle_entries([job.entry])
            self.observers.notify(
                DeadLettered(self.streams.keys.model, job.entry.lane, job.code, job.reason)
            )

    def _settle_entries(self, entries: Sequence[Entry]) -> None:
        if self._settled is not None:
            self._settled(entries)

    def _done(self, job: _Job) -> None:
        if isinstance(job, _Finish):
            with self._lock:
                self._backlog -= 1
            self._wake()


def checked(write: TokenWrite) -> TokenWrite:
    """A token write made by the writer thread: written again after a failure (maybe
    after Redis ran it, its answer lost), or behind one that failed, or retried by the
    client; checked, so ``tokens.lua`` drops what this attempt wrote already (a reader
    would take a repeated ``seq`` for a restart) and what a later attempt overtook."""
    write.life = -abs(write.life)
    return write


@dataclass
class MemorySink:
    """Keeps results in memory like Redis would (first result stands, published once).

    ``hold=True`` keeps what is sent in ``backlog`` until :meth:`flush` (to test the loop's
    behaviour while results pile up)."""

    model: str
    observers: Observers = field(default_factory=Observers)
    wake: Callable[[], None] = lambda: None
    hold: bool = False
    results: dict[str, bytes] = field(default_factory=dict)
    published: dict[str, list[bytes]] = field(default_factory=dict)
    streamed: dict[str, list[Streamed]] = field(default_factory=dict)
    tokens: dict[str, list[dict[bytes, bytes]]] = field(default_factory=dict)
    """Token-stream entries, as Redis would hold them."""
    started_ids: list[str] = field(default_factory=list)
    """Requests marked started, in order (a request admitted again: again)."""
    dead: list[tuple[Entry, str, str]] = field(default_factory=list)
    acked: list[Entry] = field(default_factory=list)
    sent: list[list[Outgoing]] = field(default_factory=list)
    _pending: list[list[Outgoing]] = field(default_factory=list)

    @property
    def backlog(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        pass

    def send(self, answers: Sequence[Outgoing]) -> None:
        if answers:
            self._pending.append(list(answers))
            if not self.hold:
                self.flush()

    def flush(self) -> None:
        """Store everything sent so far."""
        while self._pending:
            batch = self._pending.pop(0)
            self.sent.append(batch)
            replies = []
            for a in batch:
                f, reply = a.encode()
                new = f.request_id not in self.results
                if new:
                    self.results[f.request_id] = f.payload
                    if f.end is not None:  # appended with the result, as finish.lua does
                        end = f.end
                        self.stream([Streamed(f.request_id, end.seq, None, end.ttl_s, None,
                                              a.fmt, life=end.life)])  # fmt: skip
                stored = self.results[f.request_id]
                if f.reply:  # first result, or the stored one again for a duplicate entry
                    self.published.setdefault(f.reply, []).append(stored)
                self.acked.append(f.entry)
                replies.append(reply if new else replace(reply, stored=False))
            self.observers.notify(Answered(self.model, replies))
            self.wake()

    def stream_now(self, items: Sequence[Streamed]) -> None:
        self.stream(items)

    def stream(self, items: Sequence[Streamed]) -> None:
        for it in items:  # as tokens.lua writes them
            self.streamed.setdefault(it.request_id, []).append(it)
            delta = it.delta
            if delta is None:
                self.tokens.setdefault(it.request_id, []).append(end_fields(it.seq))
                continue
            self.tokens.setdefault(it.request_id, []).append(delta_fields(delta))
            if it.reply:
                self.published.setdefault(it.reply, []).append(encode_delta(delta, it.fmt))

    def started(self, items: Sequence[tuple[str, int]]) -> None:
        self.started_ids += [request_id for request_id, _ in items]

    def dead_letter(self, entry: Entry, code: str, reason: str) -> None:
        self.dead.append((entry, code, reason))
        self.acked.append(entry)
        self.observers.notify(DeadLettered(self.model, entry.lane, code, reason))

    def retire(self, items: Sequence[Retiring]) -> None:
        for it in items:
            if it.request_id in self.results:
                if it.reply:
                    self.published.setdefault(it.reply, []).append(self.results[it.request_id])
                self.acked.append(it.entry)

    def close(self, timeout: float | None = None) -> None:
        with contextlib.suppress(Exception):
            self.flush()
