"""The asyncio producer's waits end when asked: a cancel wherever it lands (a ``wait_for``
around ``job.result()`` ends at its own timeout, not the job's), and a close of the
producer while they wait. Real Redis; the test plays the worker, which never answers."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
from batchfleet.producer import AsyncJob, AsyncProducer, ProducerClosed, ResultTimeout
from gateway_fakes import ScriptedWorker

from batchfleet.redis_server import LocalRedis

TRIES = 120  # each lands the cancel a few event-loop turns later than the last
TURNS = 100  # event-loop turns a read takes to end once cancelled, or the producer closed
JOB_TIMEOUT_S = 30.0  # what a wait that lost its cancel runs into (a failure, not a hang)
CLOSE_GRACE_S = 10.0  # past the turns, on a loaded machine: still far short of the above

Wait = Callable[[AsyncJob], Awaitable[Any]]


@pytest.fixture
def fake(redis_url: str) -> Iterator[ScriptedWorker]:
    yield ScriptedWorker(redis.Redis.from_url(redis_url), "mm")


async def _result(job: AsyncJob) -> Any:
    return await job.result(timeout=JOB_TIMEOUT_S)


async def _stream(job: AsyncJob) -> Any:
    return [text async for text in job.stream(timeout=JOB_TIMEOUT_S)]


async def _results(job: AsyncJob) -> Any:
    return [r async for r in job.producer.results([job], timeout=JOB_TIMEOUT_S)]


WAITS = [_result, _stream, _results]


async def _submitted(producer: AsyncProducer) -> AsyncJob:
    return await producer.submit("mm", "hi", max_new_tokens=4, stream=True)


@pytest.mark.parametrize("wait", WAITS, ids=lambda w: w.__name__)
def test_a_cancelled_wait_ends_cancelled_wherever_the_cancel_lands(
    redis_url: str, fake: ScriptedWorker, wait: Wait
) -> None:
    async def go() -> dict[str, int]:
        ends = {"cancelled": 0, "went on": 0, "late": 0}
        async with AsyncProducer(redis_url) as producer:
            job = await _submitted(producer)
            for n in range(TRIES):
                task = asyncio.ensure_future(wait(job))
                for _ in range(n % 40):
                    await asyncio.sleep(0)
                task.cancel()
                for _ in range(TURNS):  # not carried into its next read (a block of 1 s)
                    if task.done():
                        break
                    await asyncio.sleep(0)
                ends["late"] += not task.done()
                try:
                    await task
                    ends["went on"] += 1
                except asyncio.CancelledError:
                    ends["cancelled"] += 1
                except ResultTimeout:  # it waited on after its cancel, to the job's timeout
                    ends["went on"] += 1
        return ends

    ends = asyncio.run(go())
    assert ends == {"cancelled": TRIES, "went on": 0, "late": 0}


def test_wait_for_around_a_result_ends_at_its_own_timeout(
    redis_url: str, fake: ScriptedWorker
) -> None:
    async def go() -> BaseException:
        async with AsyncProducer(redis_url) as producer:
            job = await _submitted(producer)
            with pytest.raises(TimeoutError) as caught:
                await asyncio.wait_for(job.result(timeout=JOB_TIMEOUT_S), 0.05)
            return caught.value

    assert not isinstance(asyncio.run(go()), ResultTimeout)  # wait_for's, not the job's


async def _ended_soon(tasks: list[asyncio.Task[Any]]) -> None:
    """Each of ``tasks`` ends within a few turns of a close (a loaded machine's socket
    close: within the grace), not at its job's timeout nor at a socket timeout (15 s)."""
    for _ in range(TURNS):  # a read under way is cut short, a poll's sleep too
        await asyncio.sleep(0)
    if not all(task.done() for task in tasks):
        await asyncio.wait(tasks, timeout=CLOSE_GRACE_S)
    assert all(task.done() for task in tasks), "under way long after close"


async def _waiting(producer: AsyncProducer, wait: Wait) -> AsyncIterator[asyncio.Task[Any]]:
    """Waits of each kind under way on their own job: past their first Redis calls."""
    for _ in range(3):
        job = await _submitted(producer)
        task = asyncio.ensure_future(wait(job))
        for _ in range(40):
            await asyncio.sleep(0)
        yield task


@pytest.mark.parametrize("wait", WAITS, ids=lambda w: w.__name__)
def test_closing_the_producer_ends_the_waits_under_way(
    redis_url: str, fake: ScriptedWorker, wait: Wait
) -> None:
    async def go() -> list[BaseException | None]:
        producer = AsyncProducer(redis_url)
        tasks = [task async for task in _waiting(producer, wait)]
        assert not any(task.done() for task in tasks)
        await producer.close()
        await _ended_soon(tasks)
        with pytest.raises(ProducerClosed):  # and anything asked of it after
            await producer.submit("mm", "late")
        return [task.exception() for task in tasks]

    ends = asyncio.run(go())
    assert all(isinstance(end, ProducerClosed) for end in ends), ends


@pytest.mark.parametrize("wait", WAITS, ids=lambda w: w.__name__)
def test_closing_ends_a_wait_whose_redis_does_not_answer(wait: Wait) -> None:
    """Whatever read a wait is in (a ``results()`` sweep's pipeline, a poll's ``GET``, a
    subscribe, a blocking read) it ends at the close: a stopped server (``SIGSTOP``: a VM
    pause) answers none of them, and redis-py would wait out its socket and connect
    timeouts (15 s and more) first. A close landing mid-sweep on a live server did the
    same, about once in 50 (no answer to a pipeline whose connection the close broke)."""
    server = LocalRedis()
    url = server.start()
    assert server.process is not None
    try:
        ScriptedWorker(redis.Redis.from_url(url), "mm")

        async def go() -> list[BaseException | None]:
            producer = AsyncProducer(url)
            job = await _submitted(producer)
            os.kill(server.process.pid, signal.SIGSTOP)
            task = asyncio.ensure_future(wait(job))
            for _ in range(40):  # (into its first read, which gets no answer)
                await asyncio.sleep(0)
            assert not task.done()
            await producer.close()
            await _ended_soon([task])
            return [task.exception()]

        ends = asyncio.run(go())
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
    assert all(isinstance(end, ProducerClosed) for end in ends), ends


@pytest.mark.parametrize("wait", WAITS, ids=lambda w: w.__name__)
@pytest.mark.parametrize("cancel_first", [True, False], ids=["cancel-close", "close-cancel"])
def test_a_cancel_that_comes_with_the_close_ends_the_wait_cancelled(
    redis_url: str, fake: ScriptedWorker, wait: Wait, cancel_first: bool
) -> None:
    """The close cuts a read by cancelling the waiting task, then takes its cancel back: a
    cancel of the caller's own, asked in the same turn, is not taken back with it."""

    async def go() -> BaseException | None:
        producer = AsyncProducer(redis_url)
        job = await _submitted(producer)
        task = asyncio.ensure_future(wait(job))
        for _ in range(40):
            await asyncio.sleep(0)
        assert not task.done()
        if cancel_first:
            task.cancel()
        closing = asyncio.ensure_future(producer.close())
        if not cancel_first:
            await asyncio.sleep(0)  # the close's first step (the cut) runs, the wait does not
            assert not task.done()
            task.cancel()
        await asyncio.wait((task, closing))
        return None if task.cancelled() else task.exception()

    assert asyncio.run(go()) is None  # cancelled, not ProducerClosed
