"""The gateway's one reply-channel subscription: it answers every waiter (a result
published while it waits, one stored before it waited, one stored with its message lost:
read by the sweep) and feeds every stream, falling back to the token stream where
messages may be lost (a ``seq`` skipped, the subscription lost and back, a result stored
before the stream was read). A real Redis; no worker: results, deltas and token-stream
entries are written as a worker writes them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import redis
from batchfleet.producer.aio import AsyncJob, AsyncProducer
from batchfleet.producer.gateway.replies import Replies, Resync, _Stream
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.codec import delta_fields, encode_delta, encode_result, end_fields
from batchfleet.schemas.errors import ResultTimeout
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Delta, Result

pytestmark = pytest.mark.timeout(60)
KEYS = ModelKeys("m")


def result(rid: str, text: str = "") -> Result:
    return Result(id=rid, model="m", status="ok", outputs=[{"text": text, "finish_reason": "stop"}])


async def live(p: AsyncProducer, sweep_s: float = 2.0) -> Replies:
    replies = Replies(p, sweep_s=sweep_s)
    replies.start()
    while not replies.live:
        await asyncio.sleep(0.01)
    return replies


def test_waiters_are_answered_by_message_store_and_sweep(redis_url: str, r: redis.Redis) -> None:
    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            replies = await live(p, sweep_s=0.0)
            jobs = {name: AsyncJob(name, "m", producer=p) for name in ("pub", "before", "lost")}
            r.set(jobs["before"].result_key, encode_result(result("before")))
            waits = {n: asyncio.ensure_future(replies.wait(j, 30)) for n, j in jobs.items()}
            while len(replies.waiting) < 2:  # "before" answered at once, from its key
                await asyncio.sleep(0.01)
            # a worker stores and publishes; the "lost" one's message never arrives
            r.set(jobs["pub"].result_key, encode_result(result("pub")))
            r.publish(p.reply_channel, encode_result(result("pub")))
            r.set(jobs["lost"].result_key, encode_result(result("lost")))
            got = {n: (await w).id for n, w in waits.items()}
            assert got == {"pub": "pub", "before": "before", "lost": "lost"}
            assert replies.waiting == {}
            with pytest.raises(ResultTimeout):
                await replies.wait(AsyncJob("never", "m", producer=p), 0.2)
            await replies.close()

    asyncio.run(go())


def delta(rid: str, seq: int, text: str) -> Delta:
    return Delta(id=rid, model="m", seq=seq, text=text, tokens=1)


class Worker:
    """Writes a request's deltas as a worker does: the token stream, then the message."""

    def __init__(self, r: redis.Redis, channel: str, rid: str) -> None:
        self.r, self.channel, self.rid = r, channel, rid

    def delta(self, seq: int, text: str, publish: bool = True) -> None:
        d = delta(self.rid, seq, text)
        self.r.xadd(KEYS.tokens(self.rid), delta_fields(d))
        if publish:
            self.r.publish(self.channel, encode_delta(d))

    def finish(self, text: str, seq: int, publish: bool = True) -> None:
        self.r.set(KEYS.result(self.rid), encode_result(result(self.rid, text)))
        if publish:
            self.r.publish(self.channel, encode_result(result(self.rid, text)))
        self.r.xadd(KEYS.tokens(self.rid), end_fields(seq))


def summary(events: list[Any]) -> list[Any]:
    return [e.text if isinstance(e, Delta) else "R" if isinstance(e, Restarted) else
            f"={e.generations()[0].text}" for e in events]  # fmt: skip


async def follow(replies: Replies, job: AsyncJob, events: list[Any], until: int) -> None:
    """Read ``job``'s events into ``events`` until ``until`` of them came."""
    async for e in replies.events(job, 10):
        events.append(e)
        if len(events) == until:
            return


def test_streams_from_messages_and_from_the_token_stream_when_one_may_be_lost(
    redis_url: str, r: redis.Redis
) -> None:
    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            replies = await live(p)

            async def case(rid: str, write: Any, until: int) -> list[Any]:
                job = AsyncJob(rid, "m", producer=p, streaming=True)
                events: list[Any] = []
                with replies.stream("m", rid):
                    reading = asyncio.ensure_future(follow(replies, job, events, until))
                    await asyncio.sleep(0.05)
                    write(Worker(r, p.reply_channel, rid))
                    await asyncio.wait_for(reading, 10)
                return summary(events)

            # in order: the messages alone
            def plain(w: Worker) -> None:
                w.delta(1, "a")
                w.delta(2, "b")
                w.finish("ab", 3)

            assert await case("plain", plain, 3) == ["a", "b", "=ab"]

            # a takeover: seq 1 again is a restart
            def again(w: Worker) -> None:
                w.delta(1, "a")
                w.delta(2, "b")
                w.delta(1, "a")
                w.finish("a", 2)

            assert await case("again", again, 5) == ["a", "b", "R", "a", "=a"]

            # a message lost (seq 2 never published): the token stream from its start
            def lost(w: Worker) -> None:
                w.delta(1, "a")
                w.delta(2, "b", publish=False)
                w.delta(3, "c")
                w.finish("abc", 4)

            assert await case("lost", lost, 6) == ["a", "R", "a", "b", "c", "=abc"]

            # the last delta lost: the result's text is not the deltas'
            def tail(w: Worker) -> None:
                w.delta(1, "a")
                w.delta(2, "b", publish=False)
                w.finish("ab", 3)

            assert await case("tail", tail, 5) == ["a", "R", "a", "b", "=ab"]

            # the subscription lost and back: the same, from the token stream
            def cut(w: Worker) -> None:
                w.delta(1, "a")
                r.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                w.delta(2, "b", publish=False)
                w.finish("ab", 3, publish=False)

            assert await case("cut", cut, 5) == ["a", "R", "a", "b", "=ab"]
            await replies.close()

    asyncio.run(go())


def test_a_stream_already_answered_is_read_from_its_token_stream(
    redis_url: str, r: redis.Redis
) -> None:
    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            replies = await live(p)
            w = Worker(r, p.reply_channel, "done")
            w.delta(1, "x", publish=False)
            w.finish("x", 2, publish=False)
            job = AsyncJob("done", "m", producer=p, streaming=True)
            events: list[Any] = []
            with replies.stream("m", "done"):
                await follow(replies, job, events, 3)
            assert summary(events) == ["R", "x", "=x"]
            await replies.close()

    asyncio.run(go())


def test_a_streams_wait_times_out_once_that_wait_lasted_the_timeout() -> None:
    """One timer a stream, not one a delta: when it fires early (set during an earlier
    wait), it checks again when the wait under way would time out (a virtual clock; the
    timer's check called as the loop would)."""

    async def go() -> None:
        now = [0.0]
        stream = _Stream("k", clock=lambda: now[0])
        first, second = delta("k", 1, "a"), delta("k", 2, "b")
        # Given an event there already: it is taken with no wait and no timer
        stream.put(first)
        assert await stream.get(5) is first and stream.timer is None
        # When the reader waits from 0 and the event comes at 3
        reading = asyncio.ensure_future(stream.get(5))
        await asyncio.sleep(0)
        assert stream.timer is not None
        now[0] = 3.0
        stream.put(second)
        assert await reading is second
        # Then a wait from 4 does not time out at 8 (9 - 4 < 5, though 8 - 0 > 5) ...
        now[0] = 4.0
        reading = asyncio.ensure_future(stream.get(5))
        await asyncio.sleep(0)
        now[0] = 8.0
        stream._check(5)
        await asyncio.sleep(0)
        assert not reading.done() and stream.timer is not None
        # ... but once it has lasted 5
        now[0] = 9.0
        stream._check(5)
        with pytest.raises(asyncio.TimeoutError):
            await reading
        # and with no timeout, no timer: events are read as they come
        stream.close()
        stream.timer = None
        reading = asyncio.ensure_future(stream.get(None))
        await asyncio.sleep(0)
        assert stream.timer is None
        stream.put(Resync())
        assert isinstance(await reading, Resync)
        assert len(stream.pending) == 0

    asyncio.run(go())


def test_a_silent_stream_ends_with_a_timeout(redis_url: str) -> None:
    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            replies = await live(p)
            job = AsyncJob("quiet", "m", producer=p, streaming=True)
            with replies.stream("m", "quiet"), pytest.raises(ResultTimeout, match="quiet"):
                async for _ in replies.events(job, 0.05):
                    pass
            assert replies.streams == {}
            await replies.close()

    asyncio.run(go())


def test_a_reconnection_sweeps_every_waiter_at_once(redis_url: str, r: redis.Redis) -> None:
    """A result stored while the subscription was away (its message lost) answers its
    waiter once the subscription is back, not a ``sweep_s`` later."""

    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            replies = await live(p, sweep_s=600.0)
            job = AsyncJob("away", "m", producer=p)
            waiting = asyncio.ensure_future(replies.wait(job, 20))
            while "away" not in replies.waiting:  # its stored result read once: none
                await asyncio.sleep(0.01)
            r.set(job.result_key, encode_result(result("away")))  # never published
            r.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            assert (await waiting).id == "away"
            await replies.close()

    asyncio.run(go())


def test_closing_ends_every_task_of_the_subscription(redis_url: str, r: redis.Redis) -> None:
    """After :meth:`Replies.close` nothing of it runs on: its sweeps end with it (a loop
    left sweeping would outlive the gateway's event loop), after a reconnection too."""

    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            before = asyncio.all_tasks()
            replies = await live(p, sweep_s=600.0)
            for _ in range(2):
                r.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                while not r.execute_command("CLIENT", "LIST", "TYPE", "pubsub"):
                    await asyncio.sleep(0.01)  # subscribed again: its sweeps woken
                await replies.close()
                assert asyncio.all_tasks() == before
                replies.start()
                while not replies.live:
                    await asyncio.sleep(0.01)
            await replies.close()
            assert asyncio.all_tasks() == before

    asyncio.run(go())


def test_a_cancel_swallowed_in_a_sweep_still_ends_the_sweeps(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep in flight when the subscription ends may swallow the cancel (redis-py does,
    on the way through a command): the sweeps still end, by their stop event, and
    :meth:`Replies.close` leaves nothing running."""
    from batchfleet.producer.gateway import replies as module

    monkeypatch.setattr(module, "SWEEP_END_S", 0.5)  # a mutant waits this long, then fails
    entered = asyncio.Event()
    calls = 0

    async def swallowing(self: Replies, older_than: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the sweep at subscription, before the sweeps' task
            return
        entered.set()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as redis-py may
            await asyncio.sleep(3600)

    monkeypatch.setattr(Replies, "_sweep", swallowing)

    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            before = asyncio.all_tasks()
            replies = await live(p, sweep_s=600.0)
            replies.resweep.set()  # a sweep of every waiter now, as after a reconnection
            await entered.wait()
            await replies.close()
            assert asyncio.all_tasks() == before

    asyncio.run(go())
