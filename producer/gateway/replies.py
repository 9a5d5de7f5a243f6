"""Everything one gateway's requests wait for, from one subscription to its reply channel.

Workers publish each result they store, and each delta of a streamed request, on the
request's reply channel (the producer's). ``job.result()`` instead polls its result key
(1 to 25 ms apart) and ``job.deltas()`` reads its token stream (one ``XREAD`` a delta):
fine for one caller, but a gateway holding a thousand requests would send Redis 40,000
reads a second while they wait, and a command per token while they stream. Here one
pub/sub connection answers every waiter and feeds every stream.

Pub/sub loses what is published while the subscriber is away, so:

- a waiter reads its stored result once when it begins (published before it waited),
  and the stored results of waiters older than ``sweep_s`` are read again every
  ``sweep_s``;
- a stream whose deltas may have been lost reads its token stream from the start
  instead, which holds every delta (:class:`Restarted` first, so that what was already
  sent is matched and skipped): when the subscription was lost and is back (redis-py's
  pub/sub reconnects and subscribes again by itself: a connect callback tells), when a
  ``seq`` skips, when the result's text is not the deltas' text, and when its result is
  stored while the stream has heard nothing for ``sweep_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ...cancels import not_lost, stop
from ...redis_errors import UNREACHABLE
from ...schemas.codec import decode_message, decode_result
from ...schemas.errors import ResultTimeout
from ...schemas.keys import ModelKeys
from ...schemas.messages import Delta, Result
from ..aio import AsyncJob, AsyncProducer
from ..tokens import DeltaFollower, Restarted

logger = logging.getLogger(__name__)

SWEEP_S = 2.0
RECONNECT_S = 0.5
MIN_SWEEP_S = 0.1
"""Sweeps are this far apart at least (a ``sweep_s`` of 0: every waiter, each time)."""
SWEEP_END_S = 5.0
"""The longest a closing subscription waits for its sweep in flight to end."""
DOWN = (*UNREACHABLE, OSError)


async def _as_it_came(message: Any) -> Any:
    """The subscription's RESP3 push handler: a message is read as it came (redis-py's own
    fetches a logger a message to log it at debug level: ~3% of the gateway's CPU a
    streamed token)."""
    return message


def _texts(result: Result) -> dict[int, str]:
    """A result's texts, per output (those not empty), to match against its deltas'."""
    return {i: g.text for i, g in enumerate(result.generations()) if g.text}


class Resync:
    """The subscription was lost and is back: messages in between may be gone."""


Event = Delta | Result | Resync


@dataclass
class _Stream:
    """One stream's events not read yet, and its reader's wait for the next (a future,
    set as one comes; a timer checks it, once per ``timeout``, not once per event)."""

    key: str
    """Its result key."""
    clock: Callable[[], float] = time.monotonic
    pending: deque[Event] = field(default_factory=deque)
    heard: float = field(default_factory=time.monotonic)
    """When its last message came (or it began)."""
    waiter: asyncio.Future[None] | None = None
    since: float = 0.0
    """When the reader began waiting (for ``waiter``)."""
    timer: asyncio.TimerHandle | None = None

    def put(self, event: Event) -> None:
        self.pending.append(event)
        self.heard = self.clock()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self, timeout: float | None) -> Event:
        """The next event; :class:`asyncio.TimeoutError` after ``timeout`` seconds of
        waiting for it."""
        while not self.pending:
            loop = asyncio.get_running_loop()
            self.waiter, self.since = loop.create_future(), self.clock()
            if timeout is not None and self.timer is None:
                self.timer = loop.call_later(timeout, self._check, timeout)
            await self.waiter
        return self.pending.popleft()

    def _check(self, timeout: float) -> None:
        """The timer: fail the wait that has lasted ``timeout``, else check again when
        the one under way would have."""
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait sets the timer again
        left = self.since + timeout - self.clock()
        if left > 0:
            self.timer = asyncio.get_running_loop().call_later(left, self._check, timeout)
        else:
            waiter.set_exception(asyncio.TimeoutError())

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class Replies:
    """Owns the waiters (request id → result key, future, since), the streams (request
    id → its events) and the subscription."""

    def __init__(self, producer: AsyncProducer, sweep_s: float = SWEEP_S) -> None:
        self.producer = producer
        self.sweep_s = sweep_s
        self.waiting: dict[str, tuple[str, asyncio.Future[Result], float]] = {}
        self.streams: dict[str, _Stream] = {}
        self.live = False
        """Subscribed now (``/health`` says so)."""
        self.subscribed = asyncio.Event()
        """Set once first subscribed."""
        self.resweep = asyncio.Event()
        """Sweep every waiter now (the subscription came back)."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Subscribe in the background (:attr:`live` once subscribed; again after a loss)."""
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            await stop(self._task)

    # --- whole results -------------------------------------------------------------------

    async def wait(self, job: AsyncJob, timeout: float | None) -> Result:
        """``job``'s result; :class:`ResultTimeout` after ``timeout`` seconds."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.waiting[job.id] = (job.result_key, future, time.monotonic())
        try:
            with contextlib.suppress(*DOWN):
                raw = await self.producer.client.get(job.result_key)
                if raw is not None:
                    return decode_result(raw)
            return await not_lost(asyncio.wait_for(future, timeout))  # (3.11's keeps no cancel)
        except asyncio.TimeoutError:
            raise ResultTimeout(f"no result for {job.id} within {timeout}s") from None
        finally:
            self.waiting.pop(job.id, None)

    # --- streams -------------------------------------------------------------------------

    @contextlib.contextmanager
    def stream(self, model: str, request_id: str) -> Any:
        """Take the deltas and result of ``request_id`` (enter before submitting it)."""
        stream = self.streams[request_id] = _Stream(ModelKeys(model).result(request_id))
        try:
            yield
        finally:
            stream.close()
            self.streams.pop(request_id, None)

    async def events(
        self, job: AsyncJob, timeout: float | None
    ) -> AsyncIterator[Delta | Restarted | Result]:
        """``job``'s deltas (a :class:`Restarted` where another worker began it again),
        then its result; inside :meth:`stream`. :class:`ResultTimeout` after ``timeout``
        seconds without one."""
        stream = self.streams[job.id]
        last = 0
        texts: dict[int, list[str]] = {}
        if await self.producer.client.exists(job.result_key):
            stream.put(Resync())  # answered already (its id sent before): replay
        while True:
            try:
                event = await stream.get(timeout)
            except asyncio.TimeoutError:
                raise ResultTimeout(f"nothing from {job.id} within {timeout}s") from None
            whole = isinstance(event, Result) and (not event.ok or _texts(event) == {
                i: "".join(pieces) for i, pieces in texts.items() if any(pieces)})  # fmt: skip
            if whole:
                yield event  # type: ignore[misc]  # a Result
                return
            if not isinstance(event, Delta) or event.seq not in (last + 1, 1):
                async for replayed in self._replay(job, timeout):
                    yield replayed
                return
            if event.seq == 1 and last:
                texts.clear()
                yield Restarted(job.id)
            last = event.seq
            texts.setdefault(event.input, []).append(event.text)
            yield event

    async def _replay(
        self, job: AsyncJob, timeout: float | None
    ) -> AsyncIterator[Delta | Restarted | Result]:
        """The token stream from its start (marked as a restart), then the stored result."""
        logger.info("reading %s's token stream: its reply-channel deltas may be lost", job.id)
        yield Restarted(job.id)
        async for event in self.producer.follow(job, DeltaFollower(), timeout):
            yield event
        yield await self.wait(job, timeout)

    def backlog(self, request_id: str) -> int:
        """Events of this stream delivered and not read yet (more to send before a flush)."""
        stream = self.streams.get(request_id)
        return 0 if stream is None else len(stream.pending)

    # --- the subscription ----------------------------------------------------------------

    def _deliver(self, message: Result | Delta) -> None:
        stream = self.streams.get(message.id)
        if stream is not None:
            stream.put(message)
            return
        entry = self.waiting.get(message.id)
        if isinstance(message, Result) and entry is not None and not entry[1].done():
            entry[1].set_result(message)

    async def _sweep(self, older_than: float) -> None:
        """Read the stored results of the waiters waiting longer than ``older_than`` s,
        and look for those of the streams silent that long (a stored one: replay)."""
        now = time.monotonic()
        due = [key for key, _, since in self.waiting.values() if now - since >= older_than]
        for start in range(0, len(due), 256):
            pipe = self.producer.client.pipeline(transaction=False)
            for key in due[start : start + 256]:
                pipe.get(key)
            for raw in await pipe.execute():
                if raw is not None:
                    self._deliver(decode_result(raw))
        silent = [(rid, s.key) for rid, s in self.streams.items() if now - s.heard >= older_than]
        for start in range(0, len(silent), 256):
            chunk = silent[start : start + 256]
            pipe = self.producer.client.pipeline(transaction=False)
            for _, key in chunk:
                pipe.exists(key)
            for (rid, _), stored in zip(chunk, await pipe.execute(), strict=True):
                if stored:
                    self._resync([rid])

    def _resync(self, request_ids: list[str] | None = None) -> None:
        """Tell these streams (default all) that messages may have been lost."""
        for rid in list(self.streams) if request_ids is None else request_ids:
            stream = self.streams.get(rid)
            if stream is not None:
                stream.put(Resync())

    def _reconnected(self, connection: Any) -> None:
        """redis-py's pub/sub connection came back (and subscribes again by itself)."""
        logger.warning("reply channel %s: reconnected; streams read their token streams",
                       self.producer.reply_channel)  # fmt: skip
        self._resync()
        self.resweep.set()

    async def _sweeping(self, stop: asyncio.Event) -> None:
        """Sweep every ``sweep_s``, and every waiter at once after a reconnection, until
        ``stop`` is set (a cancel alone may be swallowed on the way: by redis-py in a
        sweep, by ``asyncio.wait_for`` before 3.12)."""
        while not stop.is_set():
            woken = asyncio.ensure_future(self.resweep.wait())
            halted = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({woken, halted}, timeout=max(self.sweep_s, MIN_SWEEP_S),
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            finally:
                woken.cancel()
                halted.cancel()
            if stop.is_set():
                return
            everyone = self.resweep.is_set()
            self.resweep.clear()
            try:
                await self._sweep(0.0 if everyone else self.sweep_s)
            except Exception as exc:  # Redis away (the subscription tells), a refusal (ACL)
                logger.warning("reply channel %s: sweep failed: %s",
                               self.producer.reply_channel, exc)  # fmt: skip

    async def _run(self) -> None:
        channel = self.producer.reply_channel
        while True:
            pubsub = self.producer.client.pubsub(
                ignore_subscribe_messages=True, push_handler_func=_as_it_came
            )
            sweeper: asyncio.Task[None] | None = None
            stop = asyncio.Event()
            try:
                await pubsub.subscribe(channel)
                assert pubsub.connection is not None
                pubsub.connection.register_connect_callback(self._reconnected)
                self.live = True
                self.subscribed.set()
                self._resync()
                await self._sweep(0.0)
                sweeper = asyncio.ensure_future(self._sweeping(stop))
                while True:  # blocking reads: no timer a message (the sweeps have their task)
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                    if msg is not None and msg.get("type") == "message":
                        message = decode_message(msg["data"])
                        if message is not None:
                            self._deliver(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a refusal (ACL) as much as a lost connection
                level = logging.WARNING if isinstance(exc, DOWN) else logging.ERROR
                logger.log(level, "reply channel %s: %s; subscribing again", channel, exc)
                await asyncio.sleep(RECONNECT_S)
            finally:
                if sweeper is not None:  # ended before the subscription is let go
                    stop.set()
                    sweeper.cancel()
                    await asyncio.wait({sweeper}, timeout=SWEEP_END_S)
                self.live = False
                with contextlib.suppress(*DOWN):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
