"""The cancel watcher's poll: one ``MGET`` packed once per watched set, sent on a connection
of its own (real redis-server)."""

from __future__ import annotations

import contextlib

import pytest
import redis
from batchfleet.worker.cancels import CancelPoll
from batchfleet.worker.streams import ModelStreams


@pytest.fixture
def poll(redis_url: str) -> CancelPoll:
    return CancelPoll(ModelStreams(redis.Redis.from_url(redis_url), "m", 3, "c1"))


def test_each_poll_reads_the_keys_anew_and_a_new_set_is_packed_anew(
    poll: CancelPoll, r: redis.Redis
) -> None:
    keys = poll.streams.keys
    ids = ["a", "b", "c"]
    assert poll.cancelled(ids) == []
    r.set(keys.cancel("b"), 1, ex=60)
    assert poll.cancelled(ids) == ["b"]  # the same set: its command reused, the reply fresh
    r.set(keys.cancel("c"), 1, ex=60)
    assert poll.cancelled(ids) == ["b", "c"]
    assert poll.cancelled(["c", "d"]) == ["c"]  # another set
    assert poll.cancelled(["d"]) == []
    assert poll.cancelled([]) == []
    r.delete(keys.cancel("c"))
    assert poll.cancelled(ids) == ["b"]
    poll.close()


def test_a_killed_connection_fails_one_poll_at_most_and_never_misreads(
    poll: CancelPoll, r: redis.Redis
) -> None:
    r.set(poll.streams.keys.cancel("b"), 1, ex=60)
    ids = ["a", "b"]
    assert poll.cancelled(ids) == ["b"]
    r.client_kill_filter(_type="normal", skipme=True)  # every client but this one
    with contextlib.suppress(redis.ConnectionError):
        assert poll.cancelled(ids) == ["b"]
    assert poll.cancelled(ids) == ["b"]
    assert poll.cancelled(["a"]) == []
    poll.close()


def test_close_gives_the_connection_back(poll: CancelPoll) -> None:
    pool = poll.streams.client.connection_pool
    poll.cancelled(["a"])
    assert len(pool._in_use_connections) == 1
    poll.close()
    assert not pool._in_use_connections
    assert poll.cancelled(["a"]) == []  # a later poll takes one again
    poll.close()


def test_keys_of_a_changing_set_are_packed_by_their_bytes(poll: CancelPoll, r: redis.Redis) -> None:
    # Given requests whose ids are not ASCII (a key longer in bytes than in characters)
    keys = poll.streams.keys
    r.set(keys.cancel("é-1"), 1, ex=60)
    r.set(keys.cancel("日本"), 1, ex=60)
    # When the watched set changes a request at a time (its other keys' parts kept)
    found = [poll.cancelled(ids) for ids in (["a", "é-1"], ["é-1", "日本"], ["日本", "b"])]
    # Then each poll read exactly its own keys
    assert found == [["é-1"], ["é-1", "日本"], ["日本"]]
    poll.close()
