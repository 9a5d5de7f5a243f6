"""A task cancelled while its Redis Cluster command runs is cancelled: redis-py 8.2's
asyncio ``RedisCluster`` returned the reply instead (of 400 tries, 28 ``GET``, 128
``subscribe`` and 174 ``listen`` calls; the single-node client's hole,
``test_connection_cancel.py``), so ``connect_async`` gives cluster URLs
:class:`batchfleet.cluster_cancel.CancelSafeRedisCluster`. Its pipelines lost none here:
their cases guard the wrapper, they did not fail on the stock client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import test_connection_cancel as single
from cluster_helpers import LocalRedisCluster

from batchfleet.connection import connect_async
from batchfleet.send_cancel import _CancelSafeSend

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    cluster = LocalRedisCluster()
    yield cluster.start()
    cluster.stop()


async def _keys_on_every_node(client: Any) -> Any:
    """A pipeline whose commands go to all three masters at once."""
    pipe = client.pipeline(transaction=False)
    for key in ("a", "b", "c", "d", "e", "f"):
        pipe.get(key)
    return await pipe.execute()


@pytest.mark.parametrize(
    "command",
    [
        single._get,
        single._pipeline,
        _keys_on_every_node,
        single._transaction,
        single._subscribe,
        single._listen,
    ],
    ids=lambda c: c.__name__,
)
def test_a_cancellation_during_a_cluster_command_is_never_lost(
    cluster_url: str, command: Callable[[Any], Awaitable[Any]]
) -> None:
    ends = single.lost_cancellations(cluster_url, command)
    assert ends["lost"] == 0, ends
    assert ends["cancelled"] > 0, ends  # (the cancellations did land mid-command)


def test_every_node_connection_keeps_a_cancel_landing_on_its_write(cluster_url: str) -> None:
    """The nodes found at startup and later connect with :mod:`batchfleet.send_cancel`'s
    connections (RedisCluster picks the class itself)."""

    async def go() -> list[type]:
        client = connect_async(cluster_url)
        await _keys_on_every_node(client)
        classes = [type(c) for node in client.get_nodes() for c in node._connections]
        await client.aclose()
        return classes

    classes = asyncio.run(go())
    assert len(classes) >= 3  # (a connection to each master at least)
    assert all(issubclass(c, _CancelSafeSend) for c in classes), classes
