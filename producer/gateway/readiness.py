"""Whether Redis answers, for the gateway's readiness (``/health``): a PING of Redis, of
every master of a Redis Cluster (:func:`~batchfleet.connection.ping_redis`), answered
within :data:`READY_TIMEOUT_S`, or the gateway is not ready.

Bounded, so a probe is answered (503) before the deploy manifests' probe gives up: a
silent Redis (a hung network) would otherwise hold the PING for redis-py's socket timeout
times its retries, a minute. One PING in flight at a time: probes arriving meanwhile wait
on it and share its answer, so slow probes never pile pings up on a struggling Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from ...connection import AsyncClient, ping_redis
from .replies import DOWN

READY_TIMEOUT_S: Final = 2.0
"""A PING unanswered this long after it was sent: not ready. Below the readiness probes'
timeout in deploy/ (3 s), so the probe reads the 503 and its reason; well above a PING's
round trip on a busy gateway (its event loop serving streams), which should not flap."""


class Readiness:
    """PINGs Redis when a probe asks; one PING in flight at a time (its answer shared)."""

    def __init__(self, client: AsyncClient, timeout_s: float = READY_TIMEOUT_S) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self._ping: asyncio.Future[Any] | None = None
        self._sent = 0.0

    async def unready(self) -> str | None:
        """None when Redis (every master) answered a PING within :attr:`timeout_s` of its
        sending; else why not. Sends a PING unless one is in flight, whose answer it takes
        (at once where it has been in flight :attr:`timeout_s` already)."""
        if self._ping is None or self._ping.done():
            self._ping = asyncio.ensure_future(ping_redis(self.client))
            self._ping.add_done_callback(_seen)
            self._sent = time.monotonic()
        ping, left = self._ping, self._sent + self.timeout_s - time.monotonic()
        # (asyncio.wait, not wait_for: a probe that leaves cancels nothing the others share)
        await asyncio.wait({ping}, timeout=max(left, 0.0))
        if not ping.done() or ping.cancelled():
            ping.cancel()  # (the next probe after its end sends a new one)
            return f"Redis did not answer PING within {self.timeout_s:g} s"
        if isinstance(exc := ping.exception(), DOWN):
            return f"Redis unreachable: {exc}"
        if exc is not None:
            return f"Redis refused PING: {exc}"
        return None


def _seen(ping: asyncio.Future[Any]) -> None:
    """Reads a PING's end, so one no probe waited for is never logged as unretrieved."""
    if not ping.cancelled():
        ping.exception()
