"""The Redis server's clock, read locally: stream ids (and so entries' ages) use it."""

from __future__ import annotations

import math
import time

from .redis_model import ModelRedis


class RedisClock:
    """Local monotonic time mapped onto the Redis server's clock (stream ids use it).

    Reading it never touches Redis (any thread may, the device thread too); the intake
    calls :meth:`sync` on its own thread, at start and every ``refresh_s``. Before the first
    sync it is the local wall clock."""

    def __init__(self, streams: ModelRedis, refresh_s: float = 60.0) -> None:
        self._streams = streams
        self.refresh_s = refresh_s
        self._offset = time.time() - time.monotonic()
        self._synced = -math.inf

    def sync(self, force: bool = False) -> None:
        """Measure the offset to the Redis clock again, if due (or ``force``)."""
        t0 = time.monotonic()
        if not force and t0 - self._synced < self.refresh_s:
            return
        self._synced = t0  # one try per period, whatever the outcome
        server = self._streams.redis_time()
        t1 = time.monotonic()
        self._offset = server - (t0 + t1) / 2

    def __call__(self) -> float:
        return time.monotonic() + self._offset
