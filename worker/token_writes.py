"""A generating model's step deltas, written from its device thread on a connection of
their own.

Each step's deltas go to Redis in one ``tokens.lua`` call before the device runs the next
step (``deltas.py``), so the call's cost on the worker's side is both device idle time and
delta latency. Through the client, the call encoded its arguments (a key per delta) and
went through the pool and the script wrapper: about 250 microseconds more per call than
:meth:`~.streams.ModelStreams.tokens_commands`' packed bytes sent on a connection held for
it (a step of 37 deltas every 20 ms, measured on this kind of machine: 1.39 against
1.14 ms). A cluster client (no single connection pool) writes through the client.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from .streams import ModelStreams
from .token_stream import Writable


@dataclass(frozen=True, slots=True)
class Sent:
    """Calls sent and not answered yet (none: nothing sent, or written at once)."""

    commands: tuple[bytes, ...]


class TokenWrites:
    """``tokens.lua`` calls packed by :class:`~.streams.ModelStreams` and sent on one
    connection of the pool, held until :meth:`close`. Sending and reading the answers
    are apart, so the device thread steps on meanwhile (``deltas.py``); one thread at a
    time sends or reads (the sink's lock), every answer read before the next send."""

    def __init__(self, streams: ModelStreams) -> None:
        self.streams = streams
        self._pool: redis.ConnectionPool | None = getattr(streams.client, "connection_pool", None)
        self._conn: Any = None  # a redis.Connection (its methods are untyped)
        self._unread = 0
        """Calls sent whose answers are not read: the connection is dropped, not given
        back to the pool, if any are left at :meth:`close`."""
        self._lock = threading.Lock()
        """Held by a send or receive; :meth:`close` (another thread) never takes back a
        connection in use."""

    def append(self, items: Sequence[Writable]) -> None:
        """Append these entries and publish their deltas (as
        :meth:`~.streams.ModelStreams.append_tokens`); raises what Redis or the
        connection raised, the connection then dropped (never a half-read reply)."""
        self.receive(self.send(items))

    def send(self, items: Sequence[Writable]) -> Sent:
        """Send the calls that write these entries, without waiting for Redis; every
        :class:`Sent` is given to :meth:`receive` before the next ``send``."""
        if not items:
            return Sent(())
        if self._pool is None:
            self.streams.append_tokens(items)
            return Sent(())
        commands = self.streams.tokens_commands(items)
        with self._lock:
            if self._conn is None:
                self._conn = self._pool.get_connection()
            try:
                self._conn.send_packed_command(commands, check_health=False)
            except BaseException:
                self._conn.disconnect()  # reconnects with the next call
                self._unread = 0
                raise
            self._unread += len(commands)
        return Sent(tuple(commands))

    def receive(self, sent: Sent) -> None:
        """Read Redis's answers to a :meth:`send` (raising as :meth:`append`). A call
        refused ``NOSCRIPT`` (a restarted or flushed Redis) is made again, the script
        loaded."""
        if not sent.commands:
            return
        with self._lock:
            conn = self._conn
            again: list[bytes] = []
            error: redis.exceptions.ResponseError | None = None
            try:
                for command in sent.commands:  # every reply read, so none is left unread
                    self._unread -= 1
                    try:
                        conn.read_response()
                    except redis.exceptions.NoScriptError:
                        again.append(command)
                    except redis.exceptions.ResponseError as exc:
                        error = error or exc
                if again:
                    self.streams.load_tokens_script()
                    for command in again:
                        conn.send_packed_command([command], check_health=False)
                        conn.read_response()
            except redis.exceptions.ResponseError:
                raise
            except BaseException:
                conn.disconnect()
                self._unread = 0
                raise
            if error is not None:
                raise error

    def close(self, timeout: float = 1.0) -> None:
        """Give the connection back to the pool (left to the process's end if a write
        still holds it after ``timeout`` seconds)."""
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            if self._conn is not None and self._pool is not None:
                if self._unread:  # a reply left in it would answer the pool's next user
                    self._conn.disconnect()
                    self._unread = 0
                self._pool.release(self._conn)
                self._conn = None
        finally:
            self._lock.release()
