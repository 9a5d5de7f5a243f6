"""Redis connections from one URL (``redis://``, ``rediss://``, ``unix://``; ACL user:password).

Both producers and workers connect here, with bounded timeouts (a call never blocks
forever on a dead server) and retries with exponential backoff on connection errors.
A ``redis+cluster://`` (or ``rediss+cluster://``) URL names any node of a Redis Cluster
and gets a cluster client; every key of a model shares one hash slot, so the same calls
work on both.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .cancels import counter, not_lost
from .drops import CountingPool
from .redis_errors import unreachable
from .send_cancel import cancel_safe

RETRY_ON = [RedisConnectionError, RedisTimeoutError]
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")

SyncClient = redis.Redis | redis.RedisCluster
AsyncClient = aioredis.Redis | aioredis.RedisCluster


def is_cluster_url(url: str) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://`` URLs."""
    return url.partition("://")[0] in CLUSTER_SCHEMES


def plain_url(url: str) -> str:
    """The URL with a cluster scheme turned into its plain one (what redis-py parses)."""
    scheme, sep, rest = url.partition("://")
    return f"{CLUSTER_SCHEMES.get(scheme, scheme)}{sep}{rest}"


def default_url() -> str:
    """``$BATCHFLEET_REDIS_URL``, else ``$REDIS_URL``, else a local Redis on the default port."""
    return (
        os.environ.get("BATCHFLEET_REDIS_URL") or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    )


def ping_redis(client: AsyncClient) -> Awaitable[Any]:
    """A PING of Redis; of every master of a Redis Cluster (its client sends a plain PING
    to one node: a master gone silent, whose slots some models' keys, the set of models
    or a reply channel may live on, would go unseen while each command to it waits out
    redis-py's socket timeouts and the cluster client's retries, a minute)."""
    if isinstance(client, aioredis.RedisCluster):
        return client.ping(target_nodes=aioredis.RedisCluster.PRIMARIES)
    return client.ping()


def is_cluster_pipeline(pipe: object) -> bool:
    """True for a (sync or asyncio) Redis Cluster pipeline."""
    from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
    from redis.cluster import ClusterPipeline

    return isinstance(pipe, ClusterPipeline | AsyncClusterPipeline)


def timed_pipeline(client: SyncClient) -> Any:
    """A non-transactional pipeline whose first reply is Redis's ``TIME`` (one round trip);
    a Redis Cluster's refuses the keyless command: :func:`execute_timed` reads it apart
    there. Every reader of the fleet's clock with its keys goes through these two."""
    pipe = client.pipeline(transaction=False)
    if not is_cluster_pipeline(pipe):
        pipe.time()
    return pipe


def execute_timed(
    client: SyncClient, pipe: Any, raise_on_error: bool = True
) -> tuple[Sequence[Any], list[Any]]:
    """``TIME``'s reply (a cluster's: its default node's, read before the pipeline's
    replies, as on one Redis) and the replies of the commands queued on ``pipe``
    (:func:`timed_pipeline`'s)."""
    if is_cluster_pipeline(pipe):
        now = client.time()
        return now, list(pipe.execute(raise_on_error=raise_on_error))
    first, *replies = pipe.execute(raise_on_error=raise_on_error)
    return first, replies


def _queue_calls(pipe: Any, script: Any, calls: Sequence[tuple[list[Any], list[Any]]]) -> None:
    """EVALSHA on a plain pipeline; EVAL with the source on a cluster pipeline, which refuses
    EVALSHA (it cannot load a missing script on the right shard mid-pipeline)."""
    cluster = is_cluster_pipeline(pipe)
    for keys, args in calls:
        if cluster:
            pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        else:
            pipe.evalsha(script.sha, len(keys), *keys, *args)


def _no_script(replies: Sequence[Any]) -> list[int]:
    """The calls refused NOSCRIPT; raises a call's failure to reach Redis: a cluster
    pipeline hands it back as a reply with ``raise_on_error=False`` (a master killed, its
    replica not promoted yet), where a plain pipeline raises it. Raised, the caller retries
    as on one server (a submit whose outcome is unknown, sent again with the same ids). A
    temporary refusal (``NOREPLICAS``, ``CLUSTERDOWN``...) is raised so too."""
    downs = (unreachable(r) for r in replies if isinstance(r, Exception))
    if down := next((d for d in downs if d is not None), None):
        raise down
    return [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]


def run_script_calls(
    client: Any, script: Any, calls: Sequence[tuple[list[Any], list[Any]]]
) -> list[Any]:
    """Run a registered script once per ``(keys, args)`` on one pipeline; error replies come
    back as exception objects. Plain EVALSHA, without the ``SCRIPT EXISTS`` round trip that
    redis-py's pipeline adds before every execute holding a script: a NOSCRIPT reply (the
    server restarted or was flushed) loads the script and reruns just those calls."""
    pipe = client.pipeline(transaction=False)
    _queue_calls(pipe, script, calls)
    replies = list(pipe.execute(raise_on_error=False))
    if missing := _no_script(replies):
        client.script_load(script.script)
        again = run_script_calls(client, script, [calls[i] for i in missing])
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    return replies


async def run_script_calls_async(
    client: Any, script: Any, calls: Sequence[tuple[list[Any], list[Any]]]
) -> list[Any]:
    """:func:`run_script_calls` for an asyncio client."""
    pipe = client.pipeline(transaction=False)
    _queue_calls(pipe, script, calls)
    replies = list(await pipe.execute(raise_on_error=False))
    if missing := _no_script(replies):
        await client.script_load(script.script)
        again = await run_script_calls_async(client, script, [calls[i] for i in missing])
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    return replies


ASYNC_MAX_CONNECTIONS = 256
"""Connections one asyncio client opens at most (its commands in flight at once; more wait
for one)."""


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
) -> SyncClient:
    """A synchronous client returning bytes (a cluster client for a cluster URL). Its
    connections count their closes (:data:`.drops.DROPS`): a call redis-py retried by
    itself may have lost a reply."""
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries)
    if is_cluster_url(url):
        opts = _options(socket_timeout, extra)
        opts.pop("retry_on_error")  # the cluster client retries and re-routes by itself
        return redis.RedisCluster.from_url(
            plain_url(url), retry=retry, connection_pool_class=CountingPool, **opts
        )
    pool = CountingPool.from_url(url, retry=retry, **_options(socket_timeout, extra))
    return redis.Redis.from_pool(pool)


def connect_async(
    url: str, *, socket_timeout: float | None = 15.0, retries: int = 3, **extra: Any
) -> AsyncClient:
    """An asyncio client returning bytes (a cluster client for a cluster URL)."""
    from redis.asyncio.retry import Retry

    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries)
    if is_cluster_url(url):
        opts = _options(socket_timeout, extra)
        opts.pop("retry_on_error")
        opts.pop("health_check_interval")
        from .cluster_cancel import CancelSafeRedisCluster  # (it builds on this module)

        return CancelSafeRedisCluster.from_url(plain_url(url), retry=retry, **opts)
    opts = {"max_connections": ASYNC_MAX_CONNECTIONS, **_options(socket_timeout, extra)}
    return _CancelSafeRedis.from_pool(_WaitingPool.from_url(url, retry=retry, **opts))


class _CancelSafePipeline(aioredis.client.Pipeline):
    """A pipeline whose ``execute`` keeps a cancellation (:func:`.cancels.not_lost`)."""

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return await not_lost(super().execute(raise_on_error))


class _CancelSafePubSub(aioredis.client.PubSub):
    """A pub/sub whose commands (``subscribe``, ``unsubscribe``, ``ping``) and reads
    (``get_message``, ``listen``; a health check's PING) keep a cancellation
    (:func:`.cancels.not_lost`): redis-py 8.2 loses about one in six landing mid-``subscribe``."""

    async def execute_command(self, *args: Any) -> Any:
        return await not_lost(super().execute_command(*args))

    async def parse_response(self, block: bool = True, timeout: float = 0) -> Any:
        # not_lost, inlined: a read a streamed token, where its coroutine layer (and a
        # current_task() more) made the guard cost twice as much (0.9 us, not 0.5)
        count = counter()
        asked = count()
        reply = await super().parse_response(block, timeout)
        if count() > asked:
            raise asyncio.CancelledError
        return reply


class _CancelSafeRedis(aioredis.Redis):
    """redis-py's asyncio client, but a cancellation during a command is never lost
    (:func:`.cancels.not_lost`), on commands, pipelines and pub/sub."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        return await not_lost(super().execute_command(*args, **options))  # type: ignore[no-untyped-call]

    def pipeline(
        self, transaction: bool = True, shard_hint: str | None = None
    ) -> aioredis.client.Pipeline:
        return _CancelSafePipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )

    def pubsub(self, **kwargs: Any) -> aioredis.client.PubSub:
        return _CancelSafePubSub(
            self.connection_pool, event_dispatcher=self._event_dispatcher, **kwargs
        )


class _WaitingPool(aioredis.ConnectionPool):
    """Past ``max_connections`` a command waits for a free connection, where redis-py's
    pool fails it ("Too many connections": a program awaiting hundreds of results at once
    read it as Redis being down). The wait is a semaphore's, which a cancellation ends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = asyncio.Semaphore(self.max_connections)
        self.connection_class = cancel_safe(self.connection_class)  # (.send_cancel)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        await self._slots.acquire()
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except BaseException:
            self._slots.release()
            raise

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            self._slots.release()
