"""The asyncio producer's waits end when asked: a cancel wherever it lands (a ``wait_for``
around ``job.result()`` ends at its own timeout, not the job's), and a close of the
producer while they wait. Real Redis; the test plays the worker, which never answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
from batchfleet.producer import AsyncJob, AsyncProducer, ProducerClosed, ResultTimeout
from gateway_fakes import ScriptedWorker

TRIES = 120  # each lands the cancel a few event-loop turns later than the last
TURNS = 100  # event-loop turns a blocking read takes to end once the producer closes
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
        ends = {"cancelled": 0, "went on": 0}
        async with AsyncProducer(redis_url) as producer:
            job = await _submitted(producer)
            for n in range(TRIES):
                task = asyncio.ensure_future(wait(job))
                for _ in range(n % 40):
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                    ends["went on"] += 1
                except asyncio.CancelledError:
                    ends["cancelled"] += 1
                except ResultTimeout:  # it waited on after its cancel, to the job's timeout
                    ends["went on"] += 1
        return ends

    ends = asyncio.run(go())
    assert ends == {"cancelled": TRIES, "went on": 0}


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
        if wait is not _result:  # a blocking read is cut short, not waited out (a poll's
            for _ in range(TURNS):  # sleep of up to 25 ms is)
                await asyncio.sleep(0)
            if not all(task.done() for task in tasks):  # a loaded machine's socket close
                await asyncio.wait(tasks, timeout=CLOSE_GRACE_S)
            assert all(task.done() for task in tasks), "under way long after close"
        await asyncio.wait(tasks)
        with pytest.raises(ProducerClosed):  # and anything asked of it after
            await producer.submit("mm", "late")
        return [task.exception() for task in tasks]

    ends = asyncio.run(go())
    assert all(isinstance(end, ProducerClosed) for end in ends), ends
