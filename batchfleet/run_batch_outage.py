"""``batchfleet run-batch``'s watch on Redis: an outage is ridden out for the producer's
``retry_for_s`` (as its submits and cancels ride one out), then every line under way
(being sent or waiting for its result) and each that begins while it lasts is answered
:class:`~batchfleet.schemas.errors.Unavailable` (a 503 ``unavailable`` line) instead of
waiting on to ``--timeout``. A Redis that refuses and one that stays silent (a hung
network: a PING unanswered) count alike: a line never waits on redis-py's socket timeouts
and retries, which add up to a minute a command."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from .connection import ping_redis
from .producer.aio import AsyncProducer
from .producer.gateway.replies import DOWN
from .producer.submit import unavailable
from .schemas.errors import Unavailable

logger = logging.getLogger(__name__)

PING_EVERY_S: Final = 0.25
"""Seconds between the watch's pings (one command, one a master on a Redis Cluster:
nothing beside a batch's traffic)."""
PING_TIMEOUT_S: Final = 5.0
"""A PING unanswered this long (``retry_for_s`` where shorter) counts as failed: Redis is
unreachable since it was sent (redis-py's ``socket_connect_timeout``)."""
STOP_WAIT_S: Final = 5.0
"""The longest :meth:`RedisWatch.close` waits for a ping in flight to end."""


class RedisWatch:
    """Pings Redis every :data:`PING_EVERY_S`; :attr:`down` from a failed ping to an
    answered one. Once down ``retry_for_s`` in a row, :meth:`lost` returns (for every line
    under way, and each that begins while Redis stays down)."""

    def __init__(self, producer: AsyncProducer, retry_for_s: float) -> None:
        self.producer = producer
        self.retry_for_s = retry_for_s
        self.ping_timeout_s = max(min(PING_TIMEOUT_S, retry_for_s), 0.01)
        self.down_since: float | None = None
        """When the first failed ping of the outage under way was sent (None: Redis answers)."""
        self._gone = asyncio.Event()
        self._error: Unavailable | None = None
        self._closing = asyncio.Event()

    @property
    def down(self) -> bool:
        """Redis is known unreachable now (a request's cancel would wait in vain)."""
        return self.down_since is not None

    async def lost(self) -> Unavailable:
        """Returns once Redis has been unreachable for ``retry_for_s`` (at once while it
        stays so): the error the lines under way are answered with."""
        while self._error is None:
            await self._gone.wait()
        return self._error

    async def run(self) -> None:
        """Watch until :meth:`close`."""
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            while not self._closing.is_set():
                sent = time.monotonic()
                ping = asyncio.ensure_future(ping_redis(self.producer.client))
                await asyncio.wait({ping, closing}, timeout=self.ping_timeout_s,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if not ping.done():  # (its end, whatever it is, read: never reported)
                    ping.add_done_callback(lambda done: done.cancelled() or done.exception())
                    ping.cancel()
                if self._closing.is_set():
                    return
                if not ping.done() or ping.cancelled():
                    self._failed(sent, TimeoutError(f"no answer to PING in "
                                                    f"{self.ping_timeout_s:g} s"))  # fmt: skip
                elif isinstance(ping.exception(), DOWN):
                    self._failed(sent, ping.exception() or Exception())
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
        self.down_since, self._error = None, None
        self._gone.clear()

    def _failed(self, sent: float, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = sent
            logger.warning("run-batch: Redis unreachable (%s); the lines under way wait up to "
                           "%g s for it", exc, self.retry_for_s)  # fmt: skip
        down_for = time.monotonic() - self.down_since
        if down_for < self.retry_for_s:
            return
        why = Exception(f"{exc or type(exc).__name__} (unreachable {down_for:.1f} s)")
        self._error = unavailable(self.producer.url, why)
        self._gone.set()
