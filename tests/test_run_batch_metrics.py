"""``batchfleet run-batch --enable-metrics``: the fleet's queue gauges of the models the
batch uses (vLLM's ``vllm:num_requests_waiting`` / ``running``, the workers' ``batchfleet_*``
queue gauges), read from Redis when scraped and cached (a virtual clock), in-process
against a real Redis, the test playing the worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from batchfleet.schemas.keys import MODELS_KEY
from batchfleet.schemas.model_info import ModelInfo
from cluster_helpers import LocalRedisCluster
from gateway_fakes import ScriptedWorker

from batchfleet.connection import connect
from batchfleet.redis_server import free_port
from batchfleet.run_batch import Settings, run_batch
from batchfleet.run_batch_fleet import CACHE_S, FleetGauges
from batchfleet.run_batch_metrics import RunBatchMetrics

pytestmark = pytest.mark.timeout(120)

GUARD_TURNS = 10_000
"""Event-loop turns (each a scrape) a wait for the fleet may take before it is a hang."""
GUARD_S = 60.0
"""How long a run may last before the test calls it a hang (each ends far sooner)."""


def chat(custom_id: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST",
                       "url": "/v1/chat/completions", "body": body})  # fmt: skip


async def feed(*texts: str) -> AsyncIterator[str]:
    for text in texts:
        yield text + "\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Scrapes:
    """One run's metrics, scraped as the cache's (virtual) time passes."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.metrics = RunBatchMetrics(clock=self.clock)

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def fleet(self, name: str, model: str = "mm") -> float | None:
        return self.sample(name, model_name=model, engine="fleet")

    async def until(self, name: str, value: float, model: str = "mm") -> None:
        """Scrape (the cache's time passing each turn) until ``name`` of ``model`` is
        ``value``."""
        for _ in range(GUARD_TURNS):
            self.clock.now += CACHE_S
            if self.fleet(name, model) == value:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{name} of {model} never {value}: {self.fleet(name, model)}")


def test_the_fleet_s_queue_gauges_of_the_models_the_batch_uses(
    redis_url: str, r: redis.Redis
) -> None:
    # Given a fleet serving mm (one worker alive), base (an adapter "ad" on it) and other
    fake = ScriptedWorker(r, "mm")
    base = ScriptedWorker(r, "base", info=ModelInfo(task="generate", lora_adapters=["ad"]))
    ScriptedWorker(r, "other").beat()
    fake.beat()
    scrapes = Scrapes()
    metrics, clock, sample, fleet, until = (scrapes.metrics, scrapes.clock, scrapes.sample,
                                            scrapes.fleet, scrapes.until)  # fmt: skip

    async def go() -> None:
        # When the batch sends three lines to mm (by a name --model-map maps to it), one
        # to base's adapter, one to a model no worker serves; mm's worker takes two
        lines = feed(*(chat(c, "alias") for c in "abc"), chat("d", "ad"), chat("e", "nope"))
        settings = Settings(progress_s=0, models={"alias": "mm"})
        batch = asyncio.ensure_future(run_batch(redis_url, lines, [].append, settings,
                                                metrics=metrics))  # fmt: skip
        taken = [await asyncio.to_thread(fake.take) for _ in range(2)]
        await until("vllm:num_requests_waiting", 1)
        await until("vllm:num_requests_waiting", 1, "base")
        # Then the fleet's gauges say one waits (no worker read it), two run (read)
        assert fleet("vllm:num_requests_running") == 2
        assert sample("batchfleet_stream_length", model="mm", lane="1") == 3
        assert sample("batchfleet_stream_pending", model="mm", lane="1") == 2
        assert sample("batchfleet_stream_lag", model="mm", lane="1") == 1
        assert sample("batchfleet_model_workers", model="mm") == 1
        assert sample("batchfleet_dead_letter_stream_length", model="mm") == 0
        # and of base, that its adapter's line waits
        assert fleet("vllm:num_requests_waiting", "base") == 1
        assert fleet("vllm:num_requests_running", "base") == 0
        # and nothing of the models it does not use (nor of one that does not exist)
        for model in ("other", "nope", "ad", "alias"):
            assert fleet("vllm:num_requests_waiting", model) is None
            assert sample("batchfleet_model_workers", model=model) is None
        # and while Redis answers, run-batch says so
        assert sample("batchfleet_run_batch_redis_reachable") == 1
        # When a line is answered: scrapes within CACHE_S of the last read show that read
        await asyncio.to_thread(fake.ok, taken[0], [{"text": "x", "finish_reason": "stop"}])
        assert fleet("vllm:num_requests_running") == 2
        # and the next read, past it, the fleet as it is
        clock.now += CACHE_S
        assert fleet("vllm:num_requests_running") == 1
        for worker, waiting in [(fake, taken[1]), (fake, await asyncio.to_thread(fake.take)),
                                (base, await asyncio.to_thread(base.take))]:  # fmt: skip
            await asyncio.to_thread(worker.ok, waiting, [{"text": "x", "finish_reason": "stop"}])
        await batch

    asyncio.run(go())
    # Once the run ends, its fleet gauges go with it
    clock.now += CACHE_S
    assert sample("vllm:num_requests_running", model_name="mm", engine="fleet") is None


def test_a_scrape_while_redis_is_unreachable_shows_no_fleet_gauges_and_is_cached() -> None:
    clock = Clock()
    gauges = FleetGauges(f"redis://127.0.0.1:{free_port()}/0", clock)
    gauges.use("mm")
    reads: list[float] = []
    real = gauges._read

    def read() -> Any:
        reads.append(clock())
        return real()

    gauges._read = read  # type: ignore[method-assign]
    assert list(gauges.collect()) == []  # (refused: no gauges, no error)
    clock.now += CACHE_S / 2
    assert list(gauges.collect()) == []
    assert reads == [1000.0]  # the second scrape did not ask Redis again
    clock.now += CACHE_S
    gauges.collect()
    assert reads == [1000.0, 1000.0 + CACHE_S * 1.5]
    gauges.close()


async def two_lines_gauged(url: str, fake: ScriptedWorker, scrapes: Scrapes) -> None:
    """A batch of two lines to mm (one by a --model-map alias) at ``url``, one taken by
    ``fake``: the fleet's gauges of mm say so (then both are answered)."""
    lines = feed(chat("a", "alias"), chat("b", "mm"))
    settings = Settings(progress_s=0, models={"alias": "mm"})
    batch = asyncio.ensure_future(run_batch(url, lines, [].append, settings,
                                            metrics=scrapes.metrics))  # fmt: skip
    taken = await asyncio.to_thread(fake.take)
    await scrapes.until("vllm:num_requests_waiting", 1)
    assert scrapes.fleet("vllm:num_requests_running") == 1
    assert scrapes.sample("batchfleet_stream_length", model="mm", lane="1") == 2
    assert scrapes.sample("batchfleet_model_workers", model="mm") == 1
    assert scrapes.fleet("vllm:num_requests_waiting", "alias") is None
    for waiting in (taken, await asyncio.to_thread(fake.take)):
        await asyncio.to_thread(fake.ok, waiting, [{"text": "x", "finish_reason": "stop"}])
    await batch


def test_the_fleet_s_gauges_need_no_scan_nor_the_set_of_models(
    redis_url: str, r: redis.Redis
) -> None:
    # Given a fleet whose workers are older than the set of models (bf:models), read by a
    # run-batch user that may not SCAN (a shared Redis's tight ACL)
    fake = ScriptedWorker(r, "mm")
    fake.beat()
    r.delete(MODELS_KEY)
    r.acl_setuser("batch", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  commands=["+@all", "-scan", "-keys"])  # fmt: skip
    user_url = redis_url.replace("redis://", "redis://batch:pw@")
    try:
        # When a batch's lines go to mm, Then its gauges are read through its keys alone
        asyncio.run(asyncio.wait_for(two_lines_gauged(user_url, fake, Scrapes()), GUARD_S))
    finally:
        r.acl_deluser("batch")


def test_the_fleet_s_gauges_on_a_redis_cluster() -> None:
    # Given a fleet on a Redis Cluster (whose pipelines refuse TIME, a keyless command)
    cluster = LocalRedisCluster()
    url = cluster.start()
    client = connect(url)
    try:
        fake = ScriptedWorker(client, "mm")
        fake.beat()
        # When a batch's lines go to mm, Then its gauges are read
        asyncio.run(asyncio.wait_for(two_lines_gauged(url, fake, Scrapes()), GUARD_S))
    finally:
        client.close()
        cluster.stop()
