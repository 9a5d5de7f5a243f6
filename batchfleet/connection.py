"""Redis connections from one URL (``redis://``, ``rediss://``, ``unix://``; ACL user:password).

Both producers and workers connect here, with bounded timeouts (a call never blocks
forever on a dead server) and retries with exponential backoff on connection errors.
"""

from __future__ import annotations

import os
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RETRY_ON = [RedisConnectionError, RedisTimeoutError]
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def default_url() -> str:
    """``$BATCHFLEET_REDIS_URL``, else ``$REDIS_URL``, else a local Redis on the default port."""
    return (
        os.environ.get("BATCHFLEET_REDIS_URL") or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    )


def _options(socket_timeout: float | None, extra: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "socket_connect_timeout": 5.0,
        "socket_timeout": socket_timeout,
        "socket_keepalive": True,
        "health_check_interval": 30,
        "retry_on_error": RETRY_ON,
    }
    opts.update(extra)
    return opts


def connect(
    url: str, *, socket_timeout: float | None = 15.0, retries: int = 3, **extra: Any
) -> redis.Redis:
    """A synchronous client returning bytes."""
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        **_options(socket_timeout, extra),
    )


def connect_async(
    url: str, *, socket_timeout: float | None = 15.0, retries: int = 3, **extra: Any
) -> aioredis.Redis:
    """An asyncio client returning bytes."""
    from redis.asyncio.retry import Retry

    return aioredis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        **_options(socket_timeout, extra),
    )
