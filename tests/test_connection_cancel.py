"""A task cancelled while its Redis command runs is cancelled: redis-py's asyncio client
(8.2) can return the command's reply to a task whose cancellation landed mid-command, and
the task then went on into its next wait (``run-batch``'s Ctrl-C waited out an hour)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from batchfleet.connection import connect_async

TRIES = 400  # each lands the cancellation a few event-loop turns later than the last
TURNS = 100  # event-loop turns a cancelled command takes to end (no read waited out)


def lost_cancellations(redis_url: str, command: Callable[[Any], Awaitable[Any]]) -> dict[str, int]:
    """Cancel ``command`` after 0, 1, 2 ... loop turns, ``TRIES`` times: how each ended."""

    async def go() -> dict[str, int]:
        client = connect_async(redis_url)
        await client.set("k", "v")
        ends = {"cancelled": 0, "done before": 0, "lost": 0, "late": 0}

        async def run() -> int:
            await command(client)
            task = asyncio.current_task()
            assert task is not None
            return task.cancelling()

        for n in range(TRIES):
            task = asyncio.ensure_future(run())
            for _ in range(n % 40):
                await asyncio.sleep(0)
            task.cancel()
            for _ in range(TURNS):  # not carried on into a read (a pub/sub read's 1 s)
                if task.done():
                    break
                await asyncio.sleep(0)
            ends["late"] += not task.done()
            try:
                ends["lost" if await task else "done before"] += 1
            except asyncio.CancelledError:
                ends["cancelled"] += 1
        await client.aclose()
        return ends

    return asyncio.run(go())


async def _get(client: Any) -> Any:
    return await client.get("k")


async def _pipeline(client: Any) -> Any:
    pipe = client.pipeline(transaction=False)
    pipe.get("k")
    pipe.get("k")
    return await pipe.execute()


async def _transaction(client: Any) -> Any:
    pipe = client.pipeline()
    pipe.incr("n")
    return await pipe.execute()


async def _subscribe(client: Any) -> Any:
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe("c")
        await pubsub.ping()
        return await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    finally:
        await pubsub.aclose()


async def _listen(client: Any) -> Any:
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe("c")
        await client.publish("c", "m")
        async for message in pubsub.listen():
            return message
    finally:
        await pubsub.aclose()


async def _listen_health_checked(client: Any) -> Any:
    """``_listen`` with a health check due at its read: the read sends its PING first
    (redis-py's send waits in ``asyncio.wait_for``, which before Python 3.12 loses a cancel
    landing as the send ends)."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe("c")
        pubsub.connection.next_health_check = 0.0
        await client.publish("c", "m")
        async for message in pubsub.listen():
            return message
    finally:
        await pubsub.aclose()


COMMANDS = [_get, _pipeline, _transaction, _subscribe, _listen, _listen_health_checked]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.__name__)
def test_a_cancellation_during_a_command_is_never_lost(
    redis_url: str, command: Callable[[Any], Awaitable[Any]]
) -> None:
    ends = lost_cancellations(redis_url, command)
    assert ends["lost"] == 0 and ends["late"] == 0, ends
    assert ends["cancelled"] > 0, ends  # (the cancellations did land mid-command)
