"""Client cancellations of a generating model's requests.

A client cancels request ``<id>`` by setting ``bf:{model}:cancel:<id>`` (any value, with a
TTL; docs/protocol.md). This thread polls those keys for the requests the loop holds or
runs — one ``MGET`` every :data:`POLL_S` while there are any (:class:`CancelPoll`) — and
posts a :class:`~.inbox.Cancel` for each newly found one. The loop ends it with the next
step (a running request) or at once (a waiting one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import redis

from ..redis_errors import FAILED_CALL
from .inbox import Cancel, Event
from .streams import ModelStreams

logger = logging.getLogger(__name__)

POLL_S = 0.02
"""How often the cancel keys are read (a step of a small model takes about as long)."""


class CancelPoll:
    """The cancel keys of a set of requests, read with one ``MGET`` on a connection of its
    own, packed once per set.

    Polled every :data:`POLL_S` while a model generates, through the client an ``MGET`` of
    a hundred keys cost about 190 microseconds of Python (each argument encoded, the
    pool, reply callbacks: a ``PING`` alone costs 80), more than Redis takes to answer it,
    and the watched set changes far less often than it is read. The command packed for the
    current set is sent as bytes and its reply read directly: about 40 microseconds; a new
    set is packed from the last one's parts (:meth:`_pack`). A cluster client (no single
    connection pool) reads through the client."""

    def __init__(self, streams: ModelStreams) -> None:
        self.streams = streams
        self._pool: redis.ConnectionPool | None = getattr(streams.client, "connection_pool", None)
        self._conn: Any = None  # a redis.Connection (its methods are untyped)
        self._ids: tuple[str, ...] = ()
        self._packed: Any = None
        self._parts: dict[str, bytes] = {}
        """Each watched request's cancel key, packed (see :meth:`_pack`)."""

    def cancelled(self, request_ids: Sequence[str]) -> list[str]:
        """Which of these requests a client asked to cancel."""
        if not request_ids:
            return []
        if self._pool is None:
            return self.streams.cancelled(request_ids)
        ids = tuple(request_ids)  # (the watcher's own tuple: the same object, kept)
        if self._conn is None:
            self._conn = self._pool.get_connection()
        conn = self._conn
        if (ids is not self._ids and ids != self._ids) or self._packed is None:
            self._packed = self._pack(ids, conn.encoder.encode)
            self._ids = ids
        try:
            conn.send_packed_command(self._packed, check_health=False)
            found = conn.read_response()
        except BaseException:
            conn.disconnect()  # never read a half-read reply as the next poll's
            raise
        if len(found) == len(ids) and found.count(None) == len(ids):
            return []  # (the usual reply: no cancel, seen without a loop in Python)
        return [r for r, v in zip(ids, found, strict=True) if v is not None]

    def _pack(self, ids: tuple[str, ...], encode: Callable[[str], bytes]) -> list[bytes]:
        """``MGET`` of these requests' cancel keys, in RESP. Each key's part is kept while
        its request is watched: the set changes by a request or two a step, and redis-py
        packing a hundred keys anew cost about a millisecond each time."""
        keys, kept = self.streams.keys, self._parts
        parts: dict[str, bytes] = {}
        for r in ids:
            part = kept.get(r)
            if part is None:
                key = encode(keys.cancel(r))
                part = b"$%d\r\n%b\r\n" % (len(key), key)
            parts[r] = part
        self._parts = parts
        head = b"*%d\r\n$4\r\nMGET\r\n" % (len(ids) + 1)
        return [head + b"".join(parts[r] for r in ids)]  # (one buffer: one send)

    def close(self) -> None:
        """Give the connection back to the pool."""
        if self._conn is not None and self._pool is not None:
            self._pool.release(self._conn)
            self._conn = None


class CancelWatch:
    """Polls the cancel keys of the requests it is told to watch.

    At saturation the thread costs the device thread the GIL it holds, so a poll does as
    little as it can: the ids to read (watched, not yet posted) are listed only when the
    set or the posted ones change, and the thread is woken early only when it sleeps with
    nothing to watch. A new set is read at the next poll, at most :data:`POLL_S` later:
    the bound on a cancel's delay, which an earlier wake-up could not shorten (a client
    sets its key at any time)."""

    def __init__(
        self,
        streams: ModelStreams,
        post: Callable[[Event], None],
        *,
        every_s: float = POLL_S,
        name: str = "cancels",
    ) -> None:
        self.streams = streams
        self._poll = CancelPoll(streams)
        self._post = post
        self._every = every_s
        self._ids: frozenset[str] = frozenset()
        self._posted: set[str] = set()
        self._targets: tuple[str, ...] | None = ()
        """The ids the next poll reads (watched, not posted); None: list them anew."""
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, request_ids: Collection[str]) -> None:
        """The requests to watch from now on (replacing the last set)."""
        ids = frozenset(request_ids)
        with self._cond:
            if ids != self._ids:
                idle = not self._ids  # the thread sleeps until there is something to watch
                self._ids = ids
                self._posted &= ids
                self._targets = None
                if idle:
                    self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _next(self, pause: float | None) -> tuple[str, ...] | None:
        """After ``pause`` seconds (or a stop), the ids to poll next; None once stopped.
        Waits without a timeout while there is nothing to watch. Under the lock."""
        cond = self._cond
        if pause is not None and not self._stop:
            cond.wait(pause)
        while not self._stop and not self._ids:
            cond.wait()
        if self._stop:
            return None
        targets = self._targets
        if targets is None:
            posted = self._posted
            targets = self._targets = tuple(i for i in self._ids if i not in posted)
        return targets

    def _run(self) -> None:
        pause: float | None = None  # (the first poll at once)
        while True:
            with self._cond:
                ids = self._next(pause)
            if ids is None:
                self._poll.close()
                return
            pause = self._every
            try:
                found = self._poll.cancelled(ids)
            except FAILED_CALL as exc:  # (a cluster's unreachable too: see redis_errors)
                logger.warning("reading cancel keys failed: %s", exc)
                continue
            if found:
                with self._cond:
                    self._posted.update(found)
                    self._targets = None
                self._post(Cancel(tuple(found)))
