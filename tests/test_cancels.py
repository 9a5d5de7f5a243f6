"""The cancel watcher's poll: one ``MGET`` packed once per watched set, sent on a connection
of its own; the watcher's thread: woken only from idle, its ids listed once per change
(real redis-server)."""

from __future__ import annotations

import contextlib
import queue

import pytest
import redis
from batchfleet.worker.cancels import CancelPoll, CancelWatch
from batchfleet.worker.inbox import Cancel, Event
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


def _watcher(redis_url: str) -> CancelWatch:
    """A watcher whose thread is not started: its state is driven by hand."""
    streams = ModelStreams(redis.Redis.from_url(redis_url), "m", 3, "c1")
    return CancelWatch(streams, lambda _: None, every_s=60.0)


def test_a_changed_set_wakes_the_watcher_only_when_it_slept_with_nothing_to_watch(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a watcher, its wake-ups counted
    watch = _watcher(redis_url)
    wakes: list[int] = []
    monkeypatch.setattr(watch._cond, "notify", lambda n=1: wakes.append(n))
    # When the set goes from none, changes while non-empty, empties and fills again
    for ids in (["a"], ["a", "b"], ["b"], ["b"], [], ["c"]):
        watch.watch(ids)
    # Then only the two fillings woke it: a changed set is read at the next poll anyway
    assert len(wakes) == 2


def test_the_ids_polled_are_listed_once_per_change_and_leave_out_the_posted(
    redis_url: str,
) -> None:
    watch = _watcher(redis_url)
    watch.watch(["a", "b", "c"])
    with watch._cond:
        first = watch._next(None)
        assert first is not None and sorted(first) == ["a", "b", "c"]
        assert watch._next(0.0) is first  # unchanged: the same tuple (its MGET kept packed)
    # When "b" is found cancelled and posted
    with watch._cond:
        watch._posted.add("b")
        watch._targets = None
        assert sorted(watch._next(0.0) or ()) == ["a", "c"]
    # And the set changes: the posted one stays out while watched, others come in
    watch.watch(["b", "c", "d"])
    with watch._cond:
        assert sorted(watch._next(0.0) or ()) == ["c", "d"]
        watch._stop = True
        assert watch._next(0.0) is None


def test_a_cancel_is_posted_once_while_watched(redis_url: str, r: redis.Redis) -> None:
    # Given a running watcher of two requests, one of them cancelled
    streams = ModelStreams(redis.Redis.from_url(redis_url), "m", 3, "c1")
    r.set(streams.keys.cancel("b"), 1, ex=60)
    posted: queue.Queue[Event] = queue.Queue()
    watch = CancelWatch(streams, posted.put, every_s=0.0)
    watch.watch(["a", "b"])
    watch.start()
    try:
        first = posted.get(timeout=30)
        # When it goes on polling (every_s 0: poll after poll), a third request joins
        # and is cancelled too
        watch.watch(["a", "b", "c"])
        r.set(streams.keys.cancel("c"), 1, ex=60)
        second = posted.get(timeout=30)
    finally:
        watch.stop()
    # Then "b" was posted once, however many polls saw its key, and "c" after it
    assert [first, second, *posted.queue] == [Cancel(("b",)), Cancel(("c",))]
