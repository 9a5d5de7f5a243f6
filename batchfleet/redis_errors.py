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

CLUSTER_DOWN: type[Exception] = getattr(
    redis.exceptions, "RedisClusterUnreachableError", RedisClusterException
)
"""A cluster's own "no node answers": redis-py 8.2 names it apart, older versions raise the
base class."""

UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, CLUSTER_DOWN)
"""Redis could not be reached (retried with a backoff), on one server or a whole cluster."""
