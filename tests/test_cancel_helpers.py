"""batchfleet.cancels: a cancel of the awaiting task comes out of the waits it wraps
(deterministic scheduling: the cancel lands in the same loop turn as the outcome)."""

from __future__ import annotations

import asyncio

import pytest

from batchfleet.cancels import not_lost, stop


def test_a_cancel_landing_with_a_wait_for_result_is_raised() -> None:
    async def go() -> None:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(not_lost(asyncio.wait_for(future, 60)))
        await asyncio.sleep(0)  # (it waits on the future)
        future.set_result(1)  # the result and the cancel in one turn: Python < 3.12's
        task.cancel()  # wait_for returns the result, as if never cancelled
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_a_cancel_while_stopping_a_task_is_raised_once_it_is_stopped() -> None:
    async def go() -> None:
        release = asyncio.Event()

        async def slow_to_stop() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await release.wait()  # (a clean-up that takes a while)
                raise

        inner = asyncio.ensure_future(slow_to_stop())
        await asyncio.sleep(0)
        stopping = asyncio.ensure_future(stop(inner))
        for _ in range(3):
            await asyncio.sleep(0)
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await inner

    asyncio.run(go())


def test_stop_drops_the_outcome_of_a_task_that_ends_otherwise() -> None:
    async def go() -> None:
        async def fails_on_cancel() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise StopAsyncIteration from None

        inner = asyncio.ensure_future(fails_on_cancel())
        await asyncio.sleep(0)
        await stop(inner)
        assert isinstance(inner.exception(), StopAsyncIteration)

    asyncio.run(go())
