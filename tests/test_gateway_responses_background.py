"""Background Responses API responses (``background: true``): answered ``queued`` at once,
polled with ``GET /v1/responses/{id}`` until final, cancelled with ``POST .../cancel``. The
gateway in-process against a real Redis, the test playing the worker, so the response is
seen before, while and after the fleet answers; and read by a second gateway."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import redis
from batchfleet.producer.gateway.app import serve
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import response_key
from batchfleet.schemas.messages import ErrorInfo, Result, Usage
from gateway_fakes import GATEWAY_KEY, ScriptedWorker, gateway_in_process, http
from test_gateway_responses_store import MODEL, Scenario, answered, chat, run

from batchfleet.connection import connect
from batchfleet.redis_server import free_port

pytestmark = pytest.mark.timeout(120)

ASK = {"model": MODEL, "input": "hello", "background": True}


async def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, raw = await http(port, method, path, body)
    return status, json.loads(raw)


async def get(port: int, response_id: str) -> dict[str, Any]:
    status, out = await call(port, "GET", f"/v1/responses/{response_id}")
    assert status == 200, out
    return dict(out)


def test_a_background_response_is_queued_then_completed_for_any_gateway(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a background request, answered before any worker took it
        status, first = await call(port, "POST", "/v1/responses", ASK)
        assert status == 200 and first["status"] == "queued" and first["background"] is True
        assert first["output"] == [] and first["store"] is True and first["usage"] is None
        assert 0 < r.ttl(response_key(first["id"])) <= 24 * 3600
        # Then the fleet request keeps its result as long as the response is kept
        taken = await asyncio.to_thread(fake.take)
        assert first["id"] == f"resp_{taken.id}" and taken.request.result_ttl_s == 24 * 3600
        assert chat(taken) == [("user", "hello")]
        assert await get(port, first["id"]) == first  # the worker has not answered
        r.expire(response_key(first["id"]), 1000)  # its TTL, as if stored long ago
        # When the worker answers
        usage = Usage(prompt_tokens=3, completion_tokens=2)
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hi there", "finish_reason": "stop"}],
                                usage)  # fmt: skip
        # Then GET shows it completed, as a response waited for is built
        done = await get(port, first["id"])
        assert done["status"] == "completed" and done["background"] is True
        assert done["output"][0]["content"][0]["text"] == "Hi there"
        assert done["usage"]["total_tokens"] == 5
        changed = ("status", "output", "usage", "completed_at")
        assert {k: v for k, v in done.items() if k not in changed} == {
            k: v for k, v in first.items() if k not in changed}  # fmt: skip
        # and it is stored so, its TTL kept (not begun again)
        record = json.loads(r.get(response_key(first["id"])) or b"")
        assert record["response"] == done and "pending" not in record
        assert 0 < r.ttl(response_key(first["id"])) <= 1000
        # and another gateway (none of the first's state) reads the same, and continues it
        async with gateway_in_process(redis_url) as other:
            assert await get(other, first["id"]) == done
            taken, status, _ = await answered(other, fake, {
                "model": MODEL, "input": "more", "previous_response_id": first["id"]}, "ok")  # fmt: skip
        assert chat(taken) == [("user", "hello"), ("assistant", "Hi there"), ("user", "more")]

    run(redis_url, scenario)


def test_a_gateway_that_stops_leaves_its_background_responses_to_the_others(
    redis_url: str,
) -> None:
    fake = ScriptedWorker(connect(redis_url), MODEL)

    async def go() -> None:
        # Given a background response, taken by a worker
        port, ready, stop = free_port(), asyncio.Event(), asyncio.Event()
        server = asyncio.ensure_future(serve(redis_url, port=port, api_key=GATEWAY_KEY,
                                             ready=ready, stop=stop, grace_s=0))  # fmt: skip
        await asyncio.wait_for(ready.wait(), 20)
        _, first = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        # When its gateway stops (SIGTERM: the requests still in flight are cancelled)
        stop.set()
        await server
        # Then the background response was not in flight: not cancelled
        assert not await asyncio.to_thread(fake.cancelled, taken)
        # and once the worker answers, another gateway answers it completed
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
        async with gateway_in_process(redis_url) as other:
            assert (await get(other, first["id"]))["status"] == "completed"

    asyncio.run(go())


def test_a_background_response_not_final_cannot_be_continued_until_it_is(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        _, first = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        follow = {"model": MODEL, "input": "more", "previous_response_id": first["id"]}
        status, out = await call(port, "POST", "/v1/responses", follow)
        assert status == 400 and out["error"]["param"] == "previous_response_id"
        assert "queued" in out["error"]["message"]
        # once its result is there, continuing it settles it first (no GET needed)
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
        taken, status, _ = await answered(port, fake, follow, "ok")
        assert status == 200 and chat(taken)[1] == ("assistant", "Hi")
        assert (await get(port, first["id"]))["status"] == "completed"

    run(redis_url, scenario)


def test_cancel_stops_the_fleet_request_and_keeps_the_text_so_far(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a background response the worker took
        _, first = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        # When it is cancelled
        status, out = await call(port, "POST", f"/v1/responses/{first['id']}/cancel")
        # Then it is answered cancelled, and the fleet is told to stop generating it
        assert status == 200 and out["status"] == "cancelled" and out["output"] == []
        assert await asyncio.to_thread(fake.cancelled, taken)
        assert await get(port, first["id"]) == out
        # When the worker ends it with the text it had
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hel", "finish_reason": "cancelled"}])
        # Then it stays cancelled, with that text; cancelling again answers the same
        done = await get(port, first["id"])
        assert done["status"] == "cancelled" and done["output"][0]["content"][0]["text"] == "Hel"
        assert "pending" not in json.loads(r.get(response_key(first["id"])) or b"")
        assert await call(port, "POST", f"/v1/responses/{first['id']}/cancel") == (200, done)
        # and one the worker finished before it saw the cancel stays cancelled, as answered
        _, other = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        assert (await call(port, "POST", f"/v1/responses/{other['id']}/cancel"))[0] == 200
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hello", "finish_reason": "stop"}])
        done = await get(port, other["id"])
        assert done["status"] == "cancelled" and done["completed_at"] is None
        assert done["output"][0]["content"][0]["text"] == "Hello"

    run(redis_url, scenario)


def test_what_cannot_be_cancelled(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # a background response whose result is in (not read yet) is completed: refused
        _, first = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
        status, out = await call(port, "POST", f"/v1/responses/{first['id']}/cancel")
        assert status == 400 and out["error"]["type"] == "invalid_request_error"
        assert "completed" in out["error"]["message"]
        assert not await asyncio.to_thread(fake.cancelled, taken)
        assert (await get(port, first["id"]))["status"] == "completed"
        # a response answered at once (not background)
        _, _, whole = await answered(port, fake, {"model": MODEL, "input": "x"}, "ok")
        status, out = await call(port, "POST", f"/v1/responses/{whole['id']}/cancel")
        assert status == 400 and "background" in out["error"]["message"]
        # one never stored
        status, out = await call(port, "POST", "/v1/responses/resp_nope/cancel")
        assert status == 404 and out["error"]["code"] == "not_found"

    run(redis_url, scenario)


def test_a_fleet_error_is_a_failed_response(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        _, first = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        error = ErrorInfo(code=ErrorCode.INFERENCE_FAILED, message="CUDA out of memory")
        await asyncio.to_thread(fake.answer, taken, Result(id=taken.id, model=MODEL,
                                                           status="error", error=error))  # fmt: skip
        done = await get(port, first["id"])
        assert done["status"] == "failed" and done["output"] == []
        assert done["error"] == {"code": "server_error",
                                 "message": "inference_failed: CUDA out of memory"}  # fmt: skip

    run(redis_url, scenario)


def test_deleting_a_pending_background_response_cancels_it(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        _, first = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        assert (await call(port, "DELETE", f"/v1/responses/{first['id']}"))[0] == 200
        for _ in range(100):  # the gateway cancels it in the background
            if await asyncio.to_thread(fake.cancelled, taken):
                break
            await asyncio.sleep(0.02)
        assert await asyncio.to_thread(fake.cancelled, taken)
        assert (await call(port, "GET", f"/v1/responses/{first['id']}"))[0] == 404

    run(redis_url, scenario)


@pytest.mark.parametrize(
    ("extra", "param", "options"),
    [
        ({"store": False}, "store", {}),
        ({}, "store", {"store_ttl_s": 0}),
        ({"background": "yes"}, "background", {}),
    ],
)
def test_what_background_refuses(
    redis_url: str, r: redis.Redis, extra: dict[str, Any], param: str, options: dict[str, Any]
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        status, out = await call(port, "POST", "/v1/responses", ASK | extra)
        assert status == 400 and out["error"]["param"] == param, out
        assert not r.keys("bf:responses:*")

    run(redis_url, scenario, **options)


def test_one_too_large_to_store_is_refused_and_cancelled(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        status, out = await call(port, "POST", "/v1/responses", ASK | {"input": "x" * 5000})
        assert status == 400 and out["error"]["param"] == "background"
        taken = await asyncio.to_thread(fake.take)  # submitted before it could be stored
        for _ in range(100):  # the gateway cancels it in the background
            if await asyncio.to_thread(fake.cancelled, taken):
                break
            await asyncio.sleep(0.02)
        assert await asyncio.to_thread(fake.cancelled, taken)
        assert not r.keys("bf:responses:*")

    run(redis_url, scenario, store_max_bytes=4000)


def test_the_openai_client_creates_polls_and_cancels(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=GATEWAY_KEY,
                                    max_retries=0)  # fmt: skip
        made = await client.responses.create(model=MODEL, input="capital of France?",
                                             background=True)  # fmt: skip
        assert made.status == "queued" and made.background
        taken = await asyncio.to_thread(fake.take)
        assert (await client.responses.retrieve(made.id)).status == "queued"
        await asyncio.to_thread(fake.ok, taken, [{"text": "Paris.", "finish_reason": "stop"}])
        polled = await client.responses.retrieve(made.id)
        assert polled.status == "completed" and polled.output_text == "Paris."
        # and one cancelled
        other = await client.responses.create(model=MODEL, input="x", background=True)
        taken = await asyncio.to_thread(fake.take)
        cancelled = await client.responses.cancel(other.id)
        assert cancelled.status == "cancelled" and cancelled.id == other.id
        assert await asyncio.to_thread(fake.cancelled, taken)
        assert (await client.responses.retrieve(other.id)).status == "cancelled"
        with pytest.raises(openai.BadRequestError):
            await client.responses.cancel(made.id)
        await client.close()

    scenario_: Scenario = scenario
    run(redis_url, scenario_)
