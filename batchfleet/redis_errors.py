"""What a failed Redis call raises, on one server and on a Redis Cluster.

redis-py's cluster client raises :class:`~redis.exceptions.RedisClusterException`, which is
not a :class:`~redis.RedisError`, where the cluster side fails: in 8.2 its subclass
``RedisClusterUnreachableError`` once no node answers (every node down: an outage, as a
``ConnectionError`` is on one server; older versions raise the base class). A handler of
``redis.RedisError`` alone let it through, and the worker thread it ended stopped for good
(a cancel watcher: no cancellation seen after the outage).
"""

from __future__ import annotations

import redis
from redis.exceptions import RedisClusterException

FAILED_CALL: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
"""A Redis call failed (a command refused, a connection lost, a cluster unreachable)."""

_CLUSTER_UNREACHABLE: tuple[type[Exception], ...] = tuple(
    getattr(redis.exceptions, name)
    for name in ("RedisClusterUnreachableError",)
    if hasattr(redis.exceptions, name)
)

UNREACHABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    *_CLUSTER_UNREACHABLE,
)
"""Redis could not be reached (retried with a backoff); a cluster's own "no node answers"
where redis-py names it apart (8.2)."""
