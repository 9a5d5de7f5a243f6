"""The gateway's one reply-channel subscription answers every waiter: a result published
while it waits, one stored before it waited, and one stored with its message lost (read
by the sweep). A real Redis; no worker (results are written as a worker writes them)."""

from __future__ import annotations

import asyncio

import pytest
import redis
from batchfleet.producer.aio import AsyncJob, AsyncProducer
from batchfleet.producer.gateway.results import Results
from batchfleet.schemas.codec import encode_result
from batchfleet.schemas.errors import ResultTimeout
from batchfleet.schemas.messages import Result

pytestmark = pytest.mark.timeout(60)


def stored(rid: str) -> bytes:
    return encode_result(Result(id=rid, model="m", status="ok", outputs=[[1.0]]))


def test_waiters_are_answered_by_message_store_and_sweep(redis_url: str, r: redis.Redis) -> None:
    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            results = Results(p, sweep_s=0.0)
            await results.start()
            jobs = {name: AsyncJob(name, "m", producer=p) for name in ("pub", "before", "lost")}
            r.set(jobs["before"].result_key, stored("before"))
            waits = {n: asyncio.ensure_future(results.wait(j, 30)) for n, j in jobs.items()}
            while len(results.waiting) < 2:  # "before" answered at once, from its key
                await asyncio.sleep(0.01)
            # a worker stores and publishes; the "lost" one's message never arrives
            r.set(jobs["pub"].result_key, stored("pub"))
            r.publish(p.reply_channel, stored("pub"))
            r.set(jobs["lost"].result_key, stored("lost"))
            got = {n: (await w).id for n, w in waits.items()}
            assert got == {"pub": "pub", "before": "before", "lost": "lost"}
            assert results.waiting == {}
            with pytest.raises(ResultTimeout):
                await results.wait(AsyncJob("never", "m", producer=p), 0.2)
            await results.close()

    asyncio.run(go())
