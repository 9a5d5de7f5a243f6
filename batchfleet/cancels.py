"""Cancellations kept: awaiting something never turns a cancel of the awaiting task into
a normal return.

Three things lose one otherwise: redis-py 8.2's asyncio client, which can hand a command's
reply to a task cancelled while the command ran; Python < 3.12's ``asyncio.wait_for``,
which returns the inner result where it came at the moment of the cancel; and
``contextlib.suppress(CancelledError)`` around the await of a task one cancelled, which
swallows the awaiting task's own cancel too. A task that lost its cancel went on into its
next wait (``run-batch``'s Ctrl-C waited out its hour).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _uncounted() -> int:
    return 0


def counter(task: asyncio.Task[Any] | None = None) -> Callable[[], int]:
    """What reads :func:`cancels` of ``task`` (default: the current one): read before and
    after an await in the awaiting frame itself, it is :func:`not_lost` without a coroutine
    of its own (for an await made once a message, such as a pub/sub read)."""
    task = task if task is not None else asyncio.current_task()
    count: Callable[[], int] | None = getattr(task, "cancelling", None)
    return count if count is not None else _uncounted


def cancels(task: asyncio.Task[Any] | None = None) -> int:
    """The cancellations asked of ``task`` (default: the current one) and not withdrawn
    (0 before Python 3.11, which does not count them)."""
    return counter(task)()


async def not_lost(call: Awaitable[T]) -> T:
    """``call``'s result, or :class:`asyncio.CancelledError` where the current task was
    cancelled while it ran and the cancel did not come out of it."""
    count = counter()
    asked = count()
    reply = await call
    if count() > asked:
        raise asyncio.CancelledError
    return reply


async def stop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait for it to end, its outcome (an error too) dropped; a cancel
    of the current task while it waits is raised, not swallowed."""
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # (retrieved: not logged as never retrieved)
