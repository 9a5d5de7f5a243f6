"""The gateway's model check during a Redis Cluster failover: the master of the model's
slot ``kill -9``'d, a check begun before its replica is promoted is retried as the
producer's calls are, and passes once the replica serves the slot (where it answered a
503 before). Real processes: a 6-node cluster (``tests/failover_cluster.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
import redis
from batchfleet.producer.aio import AsyncProducer
from batchfleet.producer.gateway.app import Gateway
from batchfleet.schemas.keys import ModelKeys
from failover_cluster import FailoverCluster, running_failover_cluster

pytestmark = pytest.mark.timeout(180)

KEYS = ModelKeys("tiny")


@pytest.fixture(scope="module")
def cluster() -> Iterator[FailoverCluster]:
    with running_failover_cluster() as c:
        yield c


def test_a_model_check_in_a_failover_window_waits_for_the_promotion(
    cluster: FailoverCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # Given the model's lanes key on its master and its replica
    master = cluster.owner(KEYS.lanes_key)
    with redis.Redis(port=master) as node:
        node.set(KEYS.lanes_key, 3)
        assert node.wait(1, 10_000) == 1
    url = cluster.url_for(KEYS.lanes_key)  # (a node the failover leaves alone)

    async def go() -> None:
        async with AsyncProducer(url, retry_for_s=60) as producer:
            gateway = Gateway(producer)
            # When its master dies, and the gateway checks the model before the promotion
            failover = cluster.kill_master_of(KEYS.lanes_key)
            check = asyncio.ensure_future(gateway.check_model("tiny"))
            await asyncio.to_thread(cluster.promoted, failover, KEYS.lanes_key)
            # Then the check met the dead master, was retried, and passes
            await asyncio.wait_for(check, 60)

    with caplog.at_level(logging.WARNING, "batchfleet.producer.gateway.retried"):
        asyncio.run(go())
    assert any("model check of 'tiny'" in r.getMessage() for r in caplog.records)
