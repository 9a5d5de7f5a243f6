"""Connections dropped mid-use, counted for the whole process: each may have cost a reply.

redis-py closes a connection whenever a call on it fails (a dropped connection, a timeout:
reading on would take that call's reply for the next one's), and then mostly sends the
call again by itself: a plain client's ``Retry``, a cluster client's own loop, a cluster
pipeline sending each failed command again. When that succeeds, the caller never learns.
Most calls are none the worse, but a read that hands work over (``XREADGROUP``,
``XCLAIM``) may have been answered by Redis, its reply lost with the connection: the
entries are pending on the reader, who never saw them. A worker compares :data:`DROPS`
between passes and, when it moved, looks for such entries at once (``worker/unseen.py``)
rather than leaving them to ``claim_idle_ms``.

Counting the closes, not the retries, catches every such loss whichever way redis-py
retries (a cluster pipeline's re-send runs no backoff). A few other closes count as well (a
failed health check, a client's own ``close``): each costs a worker one needless look.
Only the connections of clients built by :func:`batchfleet.connection.connect` count.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import redis
from redis.connection import Connection


class DropCount:
    """How many live connections were closed (a counter any thread may add to)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    @property
    def value(self) -> int:
        return self._value

    def add(self) -> None:
        with self._lock:
            self._value += 1


DROPS = DropCount()
"""The connections of this process's :class:`CountingPool` pools that were closed."""


class _Counting:
    """Mixin for a redis-py connection class: closing it while connected is counted."""

    _sock: Any

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        if self._sock is not None:
            DROPS.add()
        super().disconnect(*args, **kwargs)  # type: ignore[misc]


@functools.cache
def counting(connection_class: type) -> type:
    """``connection_class`` (``Connection``, ``SSLConnection``, ...), its closes counted."""
    if issubclass(connection_class, _Counting):
        return connection_class
    return type(f"Counting{connection_class.__name__}", (_Counting, connection_class), {})


class CountingPool(redis.ConnectionPool):
    """A connection pool whose connections count their closes in :data:`DROPS`, whatever
    class the URL picks (a plain client's pool, and a cluster client's
    ``connection_pool_class``: each node's pool)."""

    def __init__(self, connection_class: type = Connection, **kwargs: Any) -> None:
        super().__init__(connection_class=counting(connection_class), **kwargs)
