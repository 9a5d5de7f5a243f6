"""The gateway's own Redis reads (is the model served?), retried as the producer's calls are.

A request's submit and its wait ride out a lost connection or a temporary refusal (a
Redis Cluster failing over: ``CLUSTERDOWN``, ``MASTERDOWN``, ``TRYAGAIN``...) for the
producer's ``retry_for_s``; the model check before them must too, or the gateway answers
503 in a window a retry would have served. Past that bound the failure is raised as a
connection error (:func:`~batchfleet.redis_errors.unreachable`), which every route
answers 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ...redis_errors import unreachable
from ..core import RetryBudget

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def retried(call: Callable[[], Awaitable[T]], retry_for_s: float, what: str) -> T:
    """``call()``'s reply, called again with the producer's backoff while Redis cannot be
    reached or refuses for now, for ``retry_for_s`` from the first failure; then that
    failure, as a connection error. ``what``: the call, for the log."""
    budget = RetryBudget(retry_for_s)
    while True:
        try:
            return await call()
        except Exception as exc:
            down = unreachable(exc)
            if down is None:
                raise
            pause = budget.next_pause()
            if pause is None:
                raise down  # noqa: B904 (down is exc, or carries it as its cause)
            logger.warning("Redis unreachable (%s); retrying %s in %.2fs", down, what, pause)
            await asyncio.sleep(pause)
