"""redis-py's asyncio Redis Cluster client, but a cancellation during a command is never lost.

redis-py 8.2's cluster client has the single-node client's hole (see
:mod:`batchfleet.cancels`): a task cancelled while its command runs can get the reply back
instead of :class:`asyncio.CancelledError`, and goes on into its next wait (of 400 tasks
cancelled 0 to 39 event-loop turns into their call, 28 ``GET``, 128 ``subscribe`` and 174
``listen`` calls returned normally; pipelines lost none). Commands, pipelines and pub/sub
are wrapped with :func:`.cancels.not_lost`.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, ClusterPubSub, RedisCluster
from redis.exceptions import RedisClusterException

from .cancels import not_lost
from .connection import _CancelSafePubSub
from .send_cancel import cancel_safe


class CancelSafeClusterPipeline(ClusterPipeline):
    """A cluster pipeline whose ``execute`` keeps a cancellation."""

    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        return await not_lost(super().execute(raise_on_error, allow_redirections))


class CancelSafeClusterPubSub(ClusterPubSub, _CancelSafePubSub):
    """A cluster pub/sub whose commands and reads keep a cancellation: ``ClusterPubSub``
    routes a command to its node and then hands it to ``PubSub.execute_command``, which the
    single-node cancel-safe pub/sub wraps (next in the MRO), as it wraps ``parse_response``
    (``get_message``, ``listen``). Sharded channels (``ssubscribe``) use plain per-node
    ``PubSub`` objects and are not covered; batchfleet does not use them."""


class CancelSafeRedisCluster(RedisCluster):
    """redis-py's asyncio cluster client; a cancellation during a command, a pipeline's
    ``execute`` or a pub/sub call is raised, never turned into the reply, nor carried from
    a command's write into its read (:mod:`.send_cancel`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # RedisCluster picks the connection class itself (plain or TLS) and hands it to
        # each node through connection_kwargs: the nodes made so far and those found later
        safe = cancel_safe(self.connection_kwargs["connection_class"])
        self.connection_kwargs["connection_class"] = safe
        self.nodes_manager.connection_kwargs["connection_class"] = safe
        for node in (*self.startup_nodes, *self.nodes_manager.startup_nodes.values()):
            node.connection_class = safe

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await not_lost(super().execute_command(*args, **kwargs))

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> ClusterPipeline:
        if shard_hint:  # (as RedisCluster.pipeline)
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        # (mypy reads redis-py's CommandsProtocol attribute _event_dispatcher as abstract;
        # ClusterPipeline, which never sets it, is built the same way by RedisCluster.pipeline)
        return CancelSafeClusterPipeline(self, transaction)  # type: ignore[abstract]

    def pubsub(
        self,
        node: ClusterNode | None = None,
        host: str | None = None,
        port: int | None = None,
        **kwargs: Any,
    ) -> ClusterPubSub:
        return CancelSafeClusterPubSub(self, node=node, host=host, port=port, **kwargs)
