"""The gateway's ``/metrics``: what its clients saw, counted once per request."""

from __future__ import annotations

import asyncio

import redis
from batchfleet.schemas.messages import Usage
from gateway_fakes import ScriptedWorker, gateway_in_process, http, leave_mid_stream
from prometheus_client.parser import text_string_to_metric_families


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample (0 where there is none)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_metrics_count_requests_tokens_streams_and_clients_that_left(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "mm")

    async def go() -> str:
        async with gateway_in_process(redis_url) as port:
            # Given an embedding answered with its usage, a key refused, a route unknown,
            ask = asyncio.ensure_future(http(port, "POST", "/v1/embeddings",
                                             {"model": "mm", "input": ["a", "b"]}))  # fmt: skip
            taken = await asyncio.to_thread(fake.take)
            await asyncio.to_thread(fake.ok, taken, [[1.0], [2.0]], Usage(prompt_tokens=9))
            assert (await ask)[0] == 200
            assert (await http(port, "POST", "/v1/embeddings", {}, key="wrong"))[0] == 401
            assert (await http(port, "GET", "/nowhere"))[0] == 404
            # a streamed chat of 2 tokens and a client that leaves mid-stream
            chat = {"model": "mm", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}  # fmt: skip
            ask = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions", chat))
            taken = await asyncio.to_thread(fake.take)
            await asyncio.to_thread(fake.delta, taken, 1, "Hi")
            await asyncio.to_thread(fake.delta, taken, 2, "!")
            await asyncio.to_thread(fake.delta, taken, 3)
            await asyncio.to_thread(fake.ok, taken, [{"text": "Hi!", "finish_reason": "stop"}],
                                    Usage(prompt_tokens=5, completion_tokens=2))  # fmt: skip
            assert (await ask)[0] == 200
            left = await leave_mid_stream(port, fake, chat)
            assert left is not None
            # (answered as a worker answers a cancelled request, which ends its handler)
            cancelled = {"text": "x", "finish_reason": "cancelled"}
            await asyncio.to_thread(fake.ok, left, [cancelled])
            # When Prometheus scrapes, without the key (once that handler has ended)
            for _ in range(200):
                status, body = await http(port, "GET", "/metrics", key=None)
                assert status == 200
                if sample(body.decode(), "batchfleet_gateway_fleet_requests_in_flight") == 0:
                    break
                await asyncio.sleep(0.05)
            return body.decode()

    try:
        text = asyncio.run(go())
    finally:
        client.close()
    requests = "batchfleet_gateway_requests_total"
    # Then each request is counted once, by route and status; the unknown path as "other"
    assert sample(text, requests, route="/v1/embeddings", status="200") == 1
    assert sample(text, requests, route="/v1/embeddings", status="401") == 1
    assert sample(text, requests, route="other", method="GET", status="404") == 1
    assert sample(text, requests, route="/v1/chat/completions", status="200") == 1
    assert sample(text, requests, route="/v1/chat/completions", status="499") == 1
    # the tokens of the results answered, by model
    assert sample(text, "batchfleet_gateway_prompt_tokens_total", model="mm") == 9 + 5
    assert sample(text, "batchfleet_gateway_completion_tokens_total", model="mm") == 2
    # the streams' first events, the durations, and nothing left in flight but the scrape
    first = "batchfleet_gateway_time_to_first_event_seconds_count"
    assert sample(text, first, route="/v1/chat/completions") == 2
    duration = "batchfleet_gateway_request_duration_seconds_count"
    assert sample(text, duration, route="/v1/embeddings") == 2
    in_flight = "batchfleet_gateway_requests_in_flight"
    assert sample(text, in_flight, route="/v1/chat/completions") == 0
    assert sample(text, in_flight, route="/metrics") == 1
    assert sample(text, "batchfleet_gateway_fleet_requests_in_flight") == 0
    assert sample(text, "batchfleet_gateway_reply_subscription_live") == 1
    assert sample(text, "process_cpu_seconds_total") > 0
