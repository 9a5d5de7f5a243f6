"""Stored Responses API responses (``store``, ``previous_response_id``, ``GET``/``DELETE
/v1/responses/{id}``, ``input_items``): the gateway in-process against a real Redis, the
test playing the worker, so the fleet requests a conversation makes are asserted on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
import redis
from batchfleet.producer.gateway.stored import ResponseStore
from batchfleet.schemas.keys import response_key
from gateway_fakes import GATEWAY_KEY, ScriptedWorker, Taken, gateway_in_process, http
from test_gateway_metrics import sample

from batchfleet.connection import connect

pytestmark = pytest.mark.timeout(120)

MODEL = "lm"
Scenario = Callable[[int, ScriptedWorker], Awaitable[None]]


def run(redis_url: str, scenario: Scenario, **options: Any) -> None:
    """``scenario(port, worker)`` against a gateway served with ``options``."""
    fake = ScriptedWorker(connect(redis_url), MODEL)

    async def go() -> None:
        async with gateway_in_process(redis_url, **options) as port:
            await scenario(port, fake)

    asyncio.run(go())


async def answered(
    port: int, fake: ScriptedWorker, body: dict[str, Any], text: str
) -> tuple[Taken, int, Any]:
    """POST ``body`` to /v1/responses, the worker answering ``text``: the request the worker
    took, the status and the JSON answer."""
    ask = asyncio.ensure_future(http(port, "POST", "/v1/responses", body))
    taken = await asyncio.to_thread(fake.take)
    await asyncio.to_thread(fake.ok, taken, [{"text": text, "finish_reason": "stop"}])
    status, raw = await ask
    return taken, status, json.loads(raw)


def chat(taken: Taken) -> list[tuple[str, Any]]:
    """The chat the worker was asked to continue: (role, content) each."""
    assert taken.request.messages is not None
    return [(m.role, m.content) for m in taken.request.messages]


async def refused(port: int, method: str, path: str, body: Any = None) -> dict[str, Any]:
    status, raw = await http(port, method, path, body)
    assert status == 404, raw
    error: dict[str, Any] = json.loads(raw)["error"]
    return error


def test_a_conversation_continues_through_previous_response_id(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a first turn, stored (the default)
        first_ask = {"model": MODEL, "instructions": "be brief", "input": "hello"}
        taken, status, first = await answered(port, fake, first_ask, "Hi there")
        assert status == 200 and chat(taken) == [("system", "be brief"), ("user", "hello")]
        assert first["store"] is True and first["previous_response_id"] is None
        assert 0 < r.ttl(response_key(first["id"])) <= 24 * 3600
        # When the next turn continues it, with other instructions
        second_ask = {"model": MODEL, "instructions": "be long", "input": "and then?",
                      "previous_response_id": first["id"]}  # fmt: skip
        taken, status, second = await answered(port, fake, second_ask, "Bye")
        # Then the worker is asked the first turn, its answer and the new input (the first
        # turn's instructions are not carried over: OpenAI's rule)
        assert status == 200 and chat(taken) == [
            ("system", "be long"), ("user", "hello"), ("assistant", "Hi there"),
            ("user", "and then?")]  # fmt: skip
        assert second["previous_response_id"] == first["id"] and second["id"] != first["id"]
        # and GET answers each stored response as it was answered
        for stored in (first, second):
            status, raw = await http(port, "GET", f"/v1/responses/{stored['id']}")
            assert status == 200 and json.loads(raw) == stored
        # and the second's input items are the whole conversation before its output
        status, raw = await http(port, "GET", f"/v1/responses/{second['id']}/input_items?order=asc")
        listed = json.loads(raw)
        assert status == 200 and listed["object"] == "list" and not listed["has_more"]
        assert [i.get("role") for i in listed["data"]] == ["user", "assistant", "user"]
        assert listed["data"][1]["id"] == first["output"][0]["id"]
        assert (listed["first_id"], listed["last_id"]) == (listed["data"][0]["id"],
                                                           listed["data"][-1]["id"])  # fmt: skip
        status, raw = await http(port, "GET", f"/v1/responses/{second['id']}/input_items?limit=1")
        newest = json.loads(raw)
        assert newest["data"] == listed["data"][-1:] and newest["has_more"]
        # When the first is deleted
        status, raw = await http(port, "DELETE", f"/v1/responses/{first['id']}")
        assert status == 200
        assert json.loads(raw) == {"id": first["id"], "object": "response", "deleted": True}
        # Then it is gone: GET, DELETE and continuing it are 404s, OpenAI-shaped
        assert (await refused(port, "GET", f"/v1/responses/{first['id']}"))["message"] == (
            f"Response with id '{first['id']}' not found.")  # fmt: skip
        await refused(port, "DELETE", f"/v1/responses/{first['id']}")
        error = await refused(port, "POST", "/v1/responses", second_ask)
        assert error == {"message": f"Previous response with id '{first['id']}' not found.",
                         "type": "invalid_request_error", "param": "previous_response_id",
                         "code": "previous_response_not_found"}  # fmt: skip
        # and the metrics label the routes by their pattern, not by id
        text = (await http(port, "GET", "/metrics", key=None))[1].decode()
        requests = "batchfleet_gateway_requests_total"
        assert sample(text, requests, route="/v1/responses/{id}", method="GET", status="200") == 2
        for status in ("200", "404"):
            assert sample(text, requests, route="/v1/responses/{id}", method="DELETE",
                          status=status) == 1  # fmt: skip
        assert sample(text, requests, route="/v1/responses/{id}/input_items", status="200") == 2
        assert sample(text, requests, route="/v1/responses", status="404") == 1

    run(redis_url, scenario)


def test_a_function_call_output_continues_the_call(redis_url: str) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}  # fmt: skip

    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a response that is a call only
        ask = asyncio.ensure_future(http(port, "POST", "/v1/responses",
                                         {"model": MODEL, "input": "weather?", "tools": tools}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, [{"text": "", "tool_calls": [call],
                                                  "finish_reason": "tool_calls"}])  # fmt: skip
        first = json.loads((await ask)[1])
        assert [i["type"] for i in first["output"]] == ["function_call"]
        # When the call's output alone continues it
        output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
        taken, status, _ = await answered(port, fake, {
            "model": MODEL, "input": [output], "tools": tools,
            "previous_response_id": first["id"]}, "Sunny in Rome.")  # fmt: skip
        # Then the worker is asked the question, the assistant's call and the tool's answer
        assert status == 200 and chat(taken) == [
            ("user", "weather?"), ("assistant", None), ("tool", "sunny")]  # fmt: skip
        messages = taken.request.messages
        assert messages is not None and messages[1].tool_calls is not None
        assert messages[1].tool_calls[0].function.arguments == '{"city":"Rome"}'
        assert messages[2].tool_call_id == "call_1"

    run(redis_url, scenario)


def test_store_false_stores_nothing_and_cannot_be_continued(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        ask = {"model": MODEL, "input": "hello", "store": False}
        _, status, out = await answered(port, fake, ask, "Hi")
        assert status == 200 and out["store"] is False
        assert not r.exists(response_key(out["id"])) and not r.keys("bf:responses:*")
        await refused(port, "GET", f"/v1/responses/{out['id']}")
        error = await refused(port, "POST", "/v1/responses",
                              {"model": MODEL, "input": "x", "previous_response_id": out["id"]})  # fmt: skip
        assert error["param"] == "previous_response_id"
        # an id never made, or not one at all, is as unknown
        for unknown in ("resp_0123", "nope", "resp_" + "x" * 200):
            error = await refused(port, "POST", "/v1/responses", {
                "model": MODEL, "input": "x", "previous_response_id": unknown})  # fmt: skip
            assert error["code"] == "previous_response_not_found"
        assert (await http(port, "POST", "/v1/responses", {
            "model": MODEL, "input": "x", "store": "yes"}))[0] == 400  # fmt: skip

    run(redis_url, scenario)


def test_a_streamed_response_is_stored_too(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a streamed response
        ask = asyncio.ensure_future(http(port, "POST", "/v1/responses",
                                         {"model": MODEL, "input": "hello", "stream": True}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.delta, taken, 1, "Hi")
        await asyncio.to_thread(fake.delta, taken, 2)
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
        status, raw = await ask
        events = [json.loads(e.split("\ndata: ")[1]) for e in raw.decode().split("\n\n") if e]
        last = events[-1]
        assert status == 200 and last["type"] == "response.completed"
        # Then the completed response is stored, and continued
        assert events[0]["response"]["store"] is True and last["response"]["store"] is True
        status, raw = await http(port, "GET", f"/v1/responses/{last['response']['id']}")
        assert status == 200 and json.loads(raw) == last["response"]
        assert r.ttl(response_key(last["response"]["id"])) > 0
        taken, status, _ = await answered(port, fake, {
            "model": MODEL, "input": "more", "previous_response_id": last["response"]["id"]},
            "ok")  # fmt: skip
        assert chat(taken) == [("user", "hello"), ("assistant", "Hi"), ("user", "more")]

    run(redis_url, scenario)


def test_the_ttl_and_the_size_bound_are_the_gateways(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        _, status, small = await answered(port, fake, {"model": MODEL, "input": "hi"}, "ok")
        assert status == 200 and small["store"] is True
        assert 0 < r.ttl(response_key(small["id"])) <= 60
        # a response over the bound is answered, says it is not stored, and is not
        _, status, big = await answered(port, fake, {"model": MODEL, "input": "x" * 5000}, "ok")
        assert status == 200 and big["store"] is False and not r.exists(response_key(big["id"]))

    run(redis_url, scenario, store_ttl_s=60, store_max_bytes=4000)
    with pytest.raises(ValueError):
        ResponseStore(connect(redis_url), ttl_s=31 * 24 * 3600)  # type: ignore[arg-type]


def test_storing_off_answers_store_false(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        _, status, out = await answered(port, fake, {"model": MODEL, "input": "hi"}, "ok")
        assert status == 200 and out["store"] is False and not r.keys("bf:responses:*")

    run(redis_url, scenario, store_ttl_s=0)


def test_the_openai_client_continues_retrieves_and_deletes(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=GATEWAY_KEY,
                                    max_retries=0)  # fmt: skip

        async def create(text: str, **ask: Any) -> tuple[Any, Taken]:
            """``client.responses.create(**ask)``, the worker answering ``text``."""
            made = asyncio.ensure_future(client.responses.create(model=MODEL, **ask))
            taken = await asyncio.to_thread(fake.take)
            await asyncio.to_thread(fake.ok, taken, [{"text": text, "finish_reason": "stop"}])
            return await made, taken

        first, _ = await create("Paris.", input="capital of France?")
        second, taken = await create("Rome.", input="and Italy?", previous_response_id=first.id)
        assert second.output_text == "Rome." and second.previous_response_id == first.id
        assert chat(taken)[-2:] == [("assistant", "Paris."), ("user", "and Italy?")]
        again = await client.responses.retrieve(second.id)
        assert again.id == second.id and again.output_text == "Rome." and again.store
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(first.id)
        assert gone.value.type == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
        assert gone.value.param == "previous_response_id"
        await client.close()

    run(redis_url, scenario)
