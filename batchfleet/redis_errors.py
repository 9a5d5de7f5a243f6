"""What a failed Redis call raises, on one server and on a Redis Cluster, and which
failures are temporary: retried, never the request's failure.

redis-py's cluster client raises :class:`~redis.exceptions.RedisClusterException`, which is
not a :class:`~redis.RedisError`, where the cluster side fails: in 8.2 its subclass
``RedisClusterUnreachableError`` once no node answers (every node down: an outage, as a
``ConnectionError`` is on one server; older versions raise the base class). A handler of
``redis.RedisError`` alone let it through, and the worker thread it ended stopped for good
(a cancel watcher: no cancellation seen after the outage).

A server that answers may still refuse a call for now: ``NOREPLICAS`` (a master with
``min-replicas-to-write`` and too few replicas, as during a failover), ``CLUSTERDOWN``,
``MASTERDOWN``, ``TRYAGAIN``, ``LOADING``, ``READONLY`` (a master turned replica). The same
call later goes through, and none of them ran any of it (a script refused at its first
write, before it wrote), so they are retried as a lost connection is:
:func:`unreachable` turns them into one.
"""

from __future__ import annotations

import re

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

REFUSED_FOR_NOW = (
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # (MASTERDOWN's MasterDownError too)
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
)
"""The temporary refusals redis-py has a class for."""

_REFUSED_CODE = re.compile(
    r"(?:^|: -?)(NOREPLICAS|TRYAGAIN|CLUSTERDOWN|MASTERDOWN|LOADING|READONLY) "
)
"""Their error codes (a refusal without a class: ``NOREPLICAS``), at the reply's start or,
refused inside a script on Redis < 7, after its ``@user_script:1: -``."""


class RefusedForNow(redis.ConnectionError):
    """Redis refused a call for now (:data:`REFUSED_FOR_NOW`, ``NOREPLICAS``): a connection
    error, as redis-py makes ``LOADING`` one, so every retry of those retries it."""


def refused_for_now(exc: BaseException) -> bool:
    """Whether ``exc`` is a temporary refusal (see the module's docstring)."""
    if isinstance(exc, REFUSED_FOR_NOW):
        return True
    if not isinstance(exc, redis.ResponseError):
        return False
    code = getattr(exc, "status_code", None)
    return bool(_REFUSED_CODE.search(f"{code} " if code and code != "ERR" else str(exc)))


def unreachable(exc: BaseException) -> Exception | None:
    """``exc`` as a failure to reach Redis, to retry (:data:`UNREACHABLE`, a temporary
    refusal as :class:`RefusedForNow`), or None where it is the call's answer."""
    if isinstance(exc, UNREACHABLE):
        return exc
    if refused_for_now(exc):
        refused = RefusedForNow(str(exc))
        refused.__cause__ = exc
        return refused
    return None
