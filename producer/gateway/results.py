"""The results every HTTP request of one gateway waits for, from one subscription.

``job.result()`` polls its result key (1 to 25 ms apart): fine for one caller, but a
gateway holding a thousand requests would send Redis 40,000 reads a second. Here one
pub/sub connection to the producer's reply channel (where workers publish each result
they store) answers every waiter; a waiter reads the stored result once when it begins
(a result published before it waited), and the stored results of waiters older than
``sweep_s`` are read again every ``sweep_s`` (pub/sub drops what arrives while
disconnected).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis

from ...schemas.codec import decode_reply, decode_result
from ...schemas.errors import ResultTimeout
from ...schemas.messages import Result
from ..aio import AsyncJob, AsyncProducer

logger = logging.getLogger(__name__)

SWEEP_S = 2.0
RECONNECT_S = 0.5
DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


class Results:
    """Owns the waiters (request id → result key, future, since) and the subscription."""

    def __init__(self, producer: AsyncProducer, sweep_s: float = SWEEP_S) -> None:
        self.producer = producer
        self.sweep_s = sweep_s
        self.waiting: dict[str, tuple[str, asyncio.Future[Result], float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        """Subscribe (before any request is submitted: none of their results is missed)."""
        self._task = asyncio.ensure_future(self._run())
        await self._subscribed.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait(self, job: AsyncJob, timeout: float | None) -> Result:
        """``job``'s result; :class:`ResultTimeout` after ``timeout`` seconds."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.waiting[job.id] = (job.result_key, future, time.monotonic())
        try:
            with contextlib.suppress(*DOWN):
                raw = await self.producer.client.get(job.result_key)
                if raw is not None:
                    return decode_result(raw)
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise ResultTimeout(f"no result for {job.id} within {timeout}s") from None
        finally:
            self.waiting.pop(job.id, None)

    def _answer(self, result: Result) -> None:
        entry = self.waiting.get(result.id)
        if entry is not None and not entry[1].done():
            entry[1].set_result(result)

    async def _sweep(self, older_than: float) -> None:
        """Read the stored results of the waiters waiting longer than ``older_than`` s."""
        now = time.monotonic()
        due = [(rid, key) for rid, (key, _, since) in self.waiting.items()
               if now - since >= older_than]  # fmt: skip
        for start in range(0, len(due), 256):
            chunk = due[start : start + 256]
            pipe = self.producer.client.pipeline(transaction=False)
            for _, key in chunk:
                pipe.get(key)
            for raw in await pipe.execute():
                if raw is not None:
                    self._answer(decode_result(raw))

    async def _run(self) -> None:
        channel = self.producer.reply_channel
        while True:
            pubsub = self.producer.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                self._subscribed.set()
                await self._sweep(0.0)
                swept = time.monotonic()
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                    if msg is not None and msg.get("type") == "message":
                        result = decode_reply(msg["data"])
                        if result is not None:
                            self._answer(result)
                    if time.monotonic() - swept >= self.sweep_s:
                        await self._sweep(self.sweep_s)
                        swept = time.monotonic()
            except DOWN as exc:
                logger.warning("reply channel %s: Redis unreachable (%s); resubscribing",
                               channel, exc)  # fmt: skip
                await asyncio.sleep(RECONNECT_S)
            finally:
                with contextlib.suppress(*DOWN):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
