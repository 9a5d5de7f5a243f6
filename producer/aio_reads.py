"""The reads an :class:`~batchfleet.producer.AsyncProducer`'s waits have under way, which
its close cuts short.

A wait (``result()``, ``results()``, ``stream()``) is a series of Redis reads and sleeps
made in the caller's own task. Left alone at a close, a read runs to its end: a blocking
read to its block, a poll's sleep to its pause, and a read whose connection the close broke
mid-reply to the 15 s socket timeout (redis-py's pipeline did, about one close in 50 that
landed on a ``results()`` sweep; a paused server answers none at all). So the close
cancels each task that is inside a read, and that read ends with :class:`ProducerClosed`.
A cancel of the caller's own that comes with it still ends the task cancelled. Writes (a
submit's script, a cancel's key) are not cut: their effect would be unknown.

The cancel lands in the caller's task, not in a task made per read (which costs ~80 us and
two event-loop turns a read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from ..schemas.errors import ProducerClosed

T = TypeVar("T")


class Reads:
    """The tasks inside a read (:meth:`cut_at_close`), and those :meth:`close` cancelled."""

    def __init__(self) -> None:
        self.closed = False
        self._under_way: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()

    async def cut_at_close(self, read: Awaitable[T]) -> T:
        """``read``'s reply, or :class:`ProducerClosed` where :meth:`close` comes first."""
        task = asyncio.current_task()
        assert task is not None, "a read outside a task"
        self._under_way.add(task)
        try:
            reply = await read
        except asyncio.CancelledError:
            if self._was_cut(task):
                raise ProducerClosed("the producer was closed") from None
            raise
        finally:
            self._under_way.discard(task)
        if self._was_cut(task):  # its cancel lost on the way (see batchfleet.cancels)
            raise ProducerClosed("the producer was closed")
        return reply

    def close(self) -> None:
        """Closed: each read under way ends with :class:`ProducerClosed`."""
        self.closed = True
        for task in self._under_way - self._cut:  # (once, however often close is called)
            self._cut.add(task)
            task.cancel()

    def _was_cut(self, task: asyncio.Task[Any]) -> bool:
        """``task``'s read was cut by :meth:`close`: its cancel taken back. False too where a
        cancel of the caller's own is pending with it (the task ends cancelled)."""
        if task not in self._cut:
            return False
        self._cut.discard(task)
        uncancel = getattr(task, "uncancel", None)  # (Python 3.11+; 3.10 counts no cancels)
        return uncancel is None or uncancel() == 0
