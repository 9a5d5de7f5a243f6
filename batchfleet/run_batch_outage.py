"""``batchfleet run-batch``'s watch on Redis while lines wait for their results: an outage
is ridden out for the producer's ``retry_for_s`` (as its submits and cancels ride one
out), then the lines waiting fail with :class:`~batchfleet.schemas.errors.Unavailable`
(their 503 ``unavailable`` error lines) instead of waiting on to ``--timeout``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from .producer.aio import AsyncProducer
from .producer.gateway.replies import DOWN, Replies
from .producer.submit import unavailable

logger = logging.getLogger(__name__)

PING_EVERY_S: Final = 0.25
"""Seconds between the watch's pings (one command: nothing beside a batch's traffic)."""
STOP_WAIT_S: Final = 5.0
"""The longest :meth:`RedisWatch.close` waits for a ping in flight to end."""


class RedisWatch:
    """Pings Redis every :data:`PING_EVERY_S`; :attr:`down` from a failed ping to an
    answered one. Once down ``retry_for_s`` in a row, every result wait under way in
    ``replies`` (and each that begins while it stays down) fails."""

    def __init__(self, producer: AsyncProducer, replies: Replies, retry_for_s: float) -> None:
        self.producer = producer
        self.replies = replies
        self.retry_for_s = retry_for_s
        self.down_since: float | None = None
        """When the first ping of the outage under way failed (None: Redis answers)."""
        self._closing = asyncio.Event()

    @property
    def down(self) -> bool:
        """Redis is known unreachable now (a request's cancel would wait in vain)."""
        return self.down_since is not None

    async def run(self) -> None:
        """Watch until :meth:`close`."""
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            while not self._closing.is_set():
                ping = asyncio.ensure_future(self.producer.client.ping())
                await asyncio.wait({ping, closing}, timeout=self.retry_for_s + 1.0,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if not ping.done():  # (its end, whatever it is, read: never reported)
                    ping.add_done_callback(lambda done: done.cancelled() or done.exception())
                    ping.cancel()
                if self._closing.is_set():
                    return
                if not ping.done() or ping.cancelled():
                    self._failed(TimeoutError("no answer to PING"))
                elif isinstance(ping.exception(), DOWN):
                    self._failed(ping.exception() or Exception())
                else:
                    self._answered()  # (a refusal, ACL's say, is an answer too)
                await asyncio.wait({closing}, timeout=PING_EVERY_S)
        finally:
            closing.cancel()

    async def close(self, task: asyncio.Future[None]) -> None:
        """End the watch running as ``task`` (a cancel alone may be swallowed by redis-py's
        connection retries, as the reply sweeps' may: :mod:`.replies`)."""
        self._closing.set()
        await asyncio.wait({task}, timeout=STOP_WAIT_S)
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.error("run-batch: the Redis watch failed", exc_info=task.exception())

    def _answered(self) -> None:
        if self.down_since is not None:
            logger.warning("run-batch: Redis answers again after %.1f s",
                           time.monotonic() - self.down_since)  # fmt: skip
        self.down_since = None

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            logger.warning("run-batch: Redis unreachable (%s); the lines waiting wait up to "
                           "%g s for it", exc, self.retry_for_s)  # fmt: skip
        if now - self.down_since < self.retry_for_s:
            return
        why = Exception(f"{exc or type(exc).__name__} (unreachable {now - self.down_since:.1f} s)")
        for _, future, _ in list(self.replies.waiting.values()):
            if not future.done():
                future.set_exception(unavailable(self.producer.url, why))
