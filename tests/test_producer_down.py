"""The producer core rides out what an unreachable Redis raises, on one server and on a
Redis Cluster that no node answers (redis-py's ``RedisClusterUnreachableError`` is no
``RedisError``): a pause and the same call again, not an error at once. Driven op by op,
no I/O."""

from __future__ import annotations

import pytest
import redis
from batchfleet.producer.core import ProducerCore, RetryBudget
from batchfleet.producer.ops import Get, Sleep, Steps
from redis.exceptions import RedisClusterUnreachableError

OUTAGES = [
    redis.ConnectionError("refused"),
    redis.TimeoutError("timed out"),
    RedisClusterUnreachableError("no node answers"),
]


@pytest.mark.parametrize("exc", OUTAGES, ids=lambda e: type(e).__name__)
def test_an_outage_is_retried_after_a_pause(exc: Exception) -> None:
    core = ProducerCore("redis://127.0.0.1:1", lambda request: request)
    steps: Steps[int] = core.lanes("mm", RetryBudget(60.0))
    first = next(steps)
    assert isinstance(first, Get)
    assert isinstance(steps.throw(exc), Sleep)  # a pause, then the same read again
    assert steps.send(None) == first
    with pytest.raises(StopIteration) as done:
        steps.send(b"2")
    assert done.value.value == 2


def test_a_refused_command_is_not_retried() -> None:
    core = ProducerCore("redis://127.0.0.1:1", lambda request: request)
    steps: Steps[int] = core.lanes("mm", RetryBudget(60.0))
    next(steps)
    with pytest.raises(redis.ResponseError):
        steps.throw(redis.ResponseError("NOPERM"))
