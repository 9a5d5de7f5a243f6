"""The Conversations API (``/v1/conversations``) and ``/v1/responses`` with
``conversation``: the gateway in-process against a real Redis, the test playing the
worker, so the chat a response continuing a conversation asks for is asserted on."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import redis
from batchfleet.producer.gateway.conversations import ConversationStore
from batchfleet.schemas.keys import ConversationKeys, response_key
from gateway_fakes import GATEWAY_KEY, ScriptedWorker, gateway_in_process, http
from test_gateway_metrics import sample
from test_gateway_responses_store import MODEL, Scenario, answered, chat

from batchfleet.connection import connect

pytestmark = pytest.mark.timeout(120)

HELLO = {"type": "message", "role": "user", "content": "hello"}


def run(redis_url: str, scenario: Scenario, **conversations: int) -> None:
    """``scenario(port, worker)`` against a gateway whose conversations are as given."""
    fake = ScriptedWorker(connect(redis_url), MODEL)

    async def go() -> None:
        async with gateway_in_process(redis_url, conversations=conversations) as port:
            await scenario(port, fake)

    asyncio.run(go())


def idle(fake: ScriptedWorker) -> bool:
    """No request waits for the worker (none was submitted)."""
    return not fake.streams.read({0: 1, 1: 1, 2: 1}, 1)


async def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, raw = await http(port, method, path, body)
    return status, json.loads(raw)


async def error(port: int, method: str, path: str, body: Any = None, status: int = 400) -> Any:
    """The error object of a call answered with ``status``."""
    got, answer = await call(port, method, path, body)
    assert got == status, answer
    return answer["error"]


def test_the_openai_client_creates_reads_changes_and_deletes(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=GATEWAY_KEY,
                                    max_retries=0)  # fmt: skip
        # Given a conversation made with two items and metadata
        made = await client.conversations.create(
            items=[{"type": "message", "role": "system", "content": "be brief"}, HELLO],
            metadata={"topic": "demo"})  # fmt: skip
        assert made.object == "conversation" and made.id.startswith("conv_")
        assert made.metadata == {"topic": "demo"}
        assert (await client.conversations.retrieve(made.id)).created_at == made.created_at
        # Then its items are stored as OpenAI answers them, newest first by default
        listed = await client.conversations.items.list(made.id)
        assert [i.role for i in listed.data] == ["user", "system"]  # type: ignore[union-attr]
        first = listed.data[1]
        assert first.id.startswith("msg_") and first.status == "completed"  # type: ignore[union-attr]
        assert first.content[0].type == "input_text"  # type: ignore[union-attr]
        assert first.content[0].text == "be brief"  # type: ignore[union-attr]
        # When three more are added, one an assistant's
        added = await client.conversations.items.create(made.id, items=[
            {"type": "message", "role": "assistant", "content": "hi"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"type": "message", "role": "user", "content": "b", "id": "msg_mine"}])  # fmt: skip
        assert [i.id for i in added.data][-1] == "msg_mine" and not added.has_more
        assert added.data[0].content[0].type == "output_text"  # type: ignore[union-attr]
        # Then pages walk them in order, with after, limit and has_more
        page = await client.conversations.items.list(made.id, order="asc", limit=2)
        assert [i.id for i in page.data] == [first.id, listed.data[0].id] and page.has_more
        assert (page.first_id, page.last_id) == (page.data[0].id, page.data[1].id)  # type: ignore[attr-defined]
        rest = await client.conversations.items.list(made.id, order="asc", after=page.data[1].id)
        assert [i.id for i in rest.data] == [*(i.id for i in added.data)] and not rest.has_more
        newest = await client.conversations.items.list(made.id, limit=1, after="msg_mine")
        assert newest.data[0].id == added.data[1].id
        got = await client.conversations.items.retrieve("msg_mine", conversation_id=made.id)
        assert got.id == "msg_mine" and got.content[0].text == "b"  # type: ignore[union-attr]
        # When an item is deleted: the conversation is answered, the item gone
        left = await client.conversations.items.delete("msg_mine", conversation_id=made.id)
        assert left.id == made.id and left.object == "conversation"
        assert len((await client.conversations.items.list(made.id, limit=100)).data) == 4
        with pytest.raises(openai.NotFoundError):
            await client.conversations.items.retrieve("msg_mine", conversation_id=made.id)
        # When its metadata is changed, it is replaced
        changed = await client.conversations.update(made.id, metadata={"topic": "other", "n": "2"})
        assert changed.metadata == {"topic": "other", "n": "2"}
        assert (await client.conversations.retrieve(made.id)).metadata == changed.metadata
        # When it is deleted, it is gone with its items
        deleted = await client.conversations.delete(made.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted",
                                                                 True)  # fmt: skip
        for gone in (lambda: client.conversations.retrieve(made.id),
                     lambda: client.conversations.delete(made.id),
                     lambda: client.conversations.items.list(made.id),
                     lambda: client.conversations.items.create(made.id, items=[HELLO]),
                     lambda: client.conversations.update(made.id, metadata={})):  # fmt: skip
            with pytest.raises(openai.NotFoundError) as refused:
                await gone()  # type: ignore[operator]
            assert refused.value.body == {  # type: ignore[comparison-overlap]
                "message": f"Conversation with id '{made.id}' not found.",
                "type": "invalid_request_error", "param": None, "code": "not_found"}  # fmt: skip
        await client.close()
        # and the metrics label the routes by their pattern, not by id
        text = (await http(port, "GET", "/metrics", key=None))[1].decode()
        requests = "batchfleet_gateway_requests_total"
        assert sample(text, requests, route="/v1/conversations", method="POST", status="200") == 1
        assert sample(text, requests, route="/v1/conversations/{id}/items", method="GET",
                      status="200") == 5  # fmt: skip
        assert sample(text, requests, route="/v1/conversations/{id}/items/{item_id}",
                      method="DELETE", status="200") == 1  # fmt: skip
        for method in ("GET", "POST", "DELETE"):
            assert sample(text, requests, route="/v1/conversations/{id}", method=method,
                          status="404") == 1  # fmt: skip

    run(redis_url, scenario)


def test_bad_requests_are_refused_with_their_field(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        for body, param in (
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
            ({"metadata": {"k": 1}}, "metadata.k"),
            ({"metadata": {"k" * 65: "v"}}, f"metadata.{'k' * 64}"),
            ({"items": [HELLO] * 21}, "items"),
            ({"items": [HELLO, {"role": "tool", "content": "x"}]}, "items[1].role"),
            ({"items": [{"type": "item_reference", "id": "x"}]}, "items[0].type"),
            ({"items": [{**HELLO, "id": "bad id"}]}, "items[0].id"),
            ({"items": [{**HELLO, "id": "m1"}, {**HELLO, "id": "m1"}]}, "items"),
        ):
            assert (await error(port, "POST", "/v1/conversations", body))["param"] == param
        _, made = await call(port, "POST", "/v1/conversations", {"items": [{**HELLO, "id": "m1"}]})
        path = f"/v1/conversations/{made['id']}"
        wrong = await error(port, "POST", f"{path}/items", {"items": [{**HELLO, "id": "m1"}]})
        assert wrong["param"] == "items" and "'m1' already" in wrong["message"]
        assert (await error(port, "POST", path, {}))["param"] == "metadata"
        for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                             ("order=up", "order"), ("after=nope", "after")):  # fmt: skip
            assert (await error(port, "GET", f"{path}/items?{query}"))["param"] == param
        for method, where in (("GET", "/items/nope"), ("DELETE", "/items/nope")):
            assert (await error(port, method, path + where, status=404))["code"] == "not_found"
        for unknown in ("conv_0123", "nope", "conv_" + "x" * 200):
            await error(port, "GET", f"/v1/conversations/{unknown}", status=404)
            await error(port, "GET", f"/v1/conversations/{unknown}/items/m1", status=404)
            await error(port, "DELETE", f"/v1/conversations/{unknown}/items/m1", status=404)
        # nothing refused was stored: the one conversation made holds its one item
        _, items = await call(port, "GET", f"{path}/items")
        assert [i["id"] for i in items["data"]] == ["m1"]

    run(redis_url, scenario)


def test_a_response_continues_a_conversation_and_is_added_to_it(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a conversation of one exchange
        _, conv = await call(port, "POST", "/v1/conversations", {"items": [
            HELLO, {"type": "message", "role": "assistant", "content": "Hi"}]})  # fmt: skip
        path = f"/v1/conversations/{conv['id']}/items?order=asc&limit=100"
        # When a response continues it (its id as conversation)
        ask = {"model": MODEL, "instructions": "be brief", "input": "more?",
               "conversation": conv["id"]}  # fmt: skip
        taken, status, first = await answered(port, fake, ask, "Sure")
        # Then the worker is asked its items then the input
        assert status == 200, first
        assert chat(taken) == [("system", "be brief"), ("user", "hello"), ("assistant", "Hi"),
                               ("user", "more?")]  # fmt: skip
        assert first["conversation"] == {"id": conv["id"]} and first["store"] is True
        # and its input and output are added to the conversation, the output by its id
        _, items = await call(port, "GET", path)
        assert [(i["role"], i["content"][0]["text"]) for i in items["data"]] == [
            ("user", "hello"),
            ("assistant", "Hi"),
            ("user", "more?"),
            ("assistant", "Sure"),
        ]
        assert items["data"][-1] == first["output"][0]
        assert items["data"][2]["id"].startswith("msg_")
        # When a streamed one continues it ({"id": ...} as conversation)
        reply = asyncio.ensure_future(http(port, "POST", "/v1/responses", {
            "model": MODEL, "input": [{**HELLO, "content": "last", "id": "msg_last"}],
            "stream": True, "conversation": {"id": conv["id"]}}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        assert chat(taken)[-3:] == [("user", "more?"), ("assistant", "Sure"), ("user", "last")]
        await asyncio.to_thread(fake.delta, taken, 1, "Bye")
        await asyncio.to_thread(fake.delta, taken, 2)
        await asyncio.to_thread(fake.ok, taken, [{"text": "Bye", "finish_reason": "stop"}])
        status, raw = await reply
        events = [json.loads(e.split("\ndata: ")[1]) for e in raw.decode().split("\n\n") if e]
        assert status == 200 and events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["conversation"] == {"id": conv["id"]}
        # Then it is added too, with the id its input item came with
        _, items = await call(port, "GET", path)
        assert [i["id"] for i in items["data"][-2:]] == [
            "msg_last", events[-1]["response"]["output"][0]["id"]]  # fmt: skip
        assert items["data"][-2]["content"] == [{"type": "input_text", "text": "last"}]
        # and a stored response continuing none says so
        _, _, plain = await answered(port, fake, {"model": MODEL, "input": "x"}, "y")
        assert plain["conversation"] is None
        # Refused before any fleet request: an unknown conversation (404), one with
        # previous_response_id, in background, an item id it holds, a bad conversation
        for bad in ("conv_nope", {"id": "conv_nope"}, "nope"):
            wrong = await error(port, "POST", "/v1/responses",
                                {"model": MODEL, "input": "x", "conversation": bad}, 404)  # fmt: skip
            assert wrong["param"] == "conversation" and "not found" in wrong["message"]
        for extra, param in (({"previous_response_id": first["id"]}, "conversation"),
                             ({"conversation": 7}, "conversation"),
                             ({"conversation": {"x": 1}}, "conversation"),
                             ({"input": [{**HELLO, "id": "msg_last"}]}, "input[0].id")):  # fmt: skip
            body = {"model": MODEL, "input": "x", "conversation": conv["id"], **extra}
            assert (await error(port, "POST", "/v1/responses", body))["param"] == param
        assert idle(fake)

    run(redis_url, scenario)


def test_a_background_response_is_added_once_settled(
    redis_url: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a conversation, and a background response continuing it
        _, conv = await call(port, "POST", "/v1/conversations", {"items": [HELLO]})
        items = f"/v1/conversations/{conv['id']}/items?order=asc"
        status, made = await call(port, "POST", "/v1/responses", {
            "model": MODEL, "input": "more?", "conversation": conv["id"], "background": True})  # fmt: skip
        assert status == 200 and made["status"] == "queued"
        assert made["conversation"] == {"id": conv["id"]}
        taken = await asyncio.to_thread(fake.take)
        assert chat(taken) == [("user", "hello"), ("user", "more?")]
        pending = r.get(response_key(made["id"]))
        # When its result is in, it is not added until a gateway reads it final
        await asyncio.to_thread(fake.ok, taken, [{"text": "Sure", "finish_reason": "stop"}])
        assert len((await call(port, "GET", items))[1]["data"]) == 1
        status, final = await call(port, "GET", f"/v1/responses/{made['id']}")
        assert status == 200 and final["status"] == "completed"
        # Then its input and output are added, once
        _, listed = await call(port, "GET", items)
        texts = [i["content"][0]["text"] for i in listed["data"]]
        assert texts == ["hello", "more?", "Sure"] and listed["data"][-1] == final["output"][0]
        # and a second settling (another gateway that read it pending at the same time)
        # adds nothing more
        r.set(response_key(made["id"]), pending or b"", keepttl=True)
        assert (await call(port, "GET", f"/v1/responses/{made['id']}"))[1] == final
        assert (await call(port, "GET", items))[1] == listed
        assert "not added" not in caplog.text  # it was: not a failure
        # A cancelled one is never added
        _, made = await call(port, "POST", "/v1/responses", {
            "model": MODEL, "input": "x", "conversation": conv["id"], "background": True})  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        assert (await call(port, "POST", f"/v1/responses/{made['id']}/cancel"))[0] == 200
        await asyncio.to_thread(fake.ok, taken, [{"text": "cut", "finish_reason": "stop"}])
        assert (await call(port, "GET", f"/v1/responses/{made['id']}"))[1]["status"] == "cancelled"
        assert (await call(port, "GET", items))[1] == listed

    run(redis_url, scenario)


def test_the_bounds_refuse_items_and_responses_past_them(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a conversation of 2 items, under a bound of 5
        _, conv = await call(port, "POST", "/v1/conversations", {"items": [HELLO, HELLO]})
        cid, keys = conv["id"], ConversationKeys(conv["id"])
        assert all(0 < r.ttl(k) <= 60 for k in keys.all)
        # a response of one input and one output fits (4 items)
        _, status, _ = await answered(port, fake, {"model": MODEL, "input": "x",
                                                   "conversation": cid}, "y")  # fmt: skip
        assert status == 200
        # When two items more are added: refused, whole (5 is the most)
        wrong = await error(port, "POST", f"/v1/conversations/{cid}/items",
                            {"items": [HELLO, HELLO]})  # fmt: skip
        assert wrong["param"] == "items" and "at most 5" in wrong["message"]
        assert r.zcard(keys.order) == 4
        # a response whose input would fill it is refused before it is submitted
        wrong = await error(port, "POST", "/v1/responses",
                            {"model": MODEL, "input": "x", "conversation": cid})  # fmt: skip
        assert wrong["param"] == "conversation"
        assert idle(fake)
        # When a response's output is past the bytes bound (2000): it is answered with
        # that error, and neither added nor stored
        _, other = await call(port, "POST", "/v1/conversations", {"items": []})
        ask = asyncio.ensure_future(http(port, "POST", "/v1/responses", {
            "model": MODEL, "input": "x", "conversation": other["id"]}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, [{"text": "z" * 3000, "finish_reason": "stop"}])
        status, raw = await ask
        assert status == 400 and json.loads(raw)["error"]["param"] == "conversation"
        assert r.zcard(ConversationKeys(other["id"]).order) == 0
        assert len(r.keys("bf:responses:*")) == 1  # the first response only
        # and an item deleted frees its bytes and its place
        first = json.loads((await http(port, "GET", f"/v1/conversations/{cid}/items"))[1])
        for item in first["data"][:2]:
            await call(port, "DELETE", f"/v1/conversations/{cid}/items/{item['id']}")
        assert (await call(port, "POST", f"/v1/conversations/{cid}/items",
                           {"items": [HELLO, HELLO, HELLO]}))[0] == 200  # fmt: skip
        held = sum(len(v) for v in r.hvals(keys.items))
        assert int(r.hget(keys.meta, "bytes") or 0) == held

    run(redis_url, scenario, ttl_s=60, max_items=5, max_bytes=2000)


def test_a_ttl_of_0_keeps_conversations_until_deleted(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        _, conv = await call(port, "POST", "/v1/conversations", {"items": [HELLO]})
        assert all(r.ttl(k) == -1 for k in ConversationKeys(conv["id"]).all)

    run(redis_url, scenario, ttl_s=0)
    with pytest.raises(ValueError):
        ConversationStore(connect(redis_url), ttl_s=-1)  # type: ignore[arg-type]


def test_appends_from_two_gateways_at_once_are_all_kept_whole(redis_url: str) -> None:
    async def go() -> None:
        async with (gateway_in_process(redis_url) as one,
                    gateway_in_process(redis_url) as two):  # fmt: skip
            _, conv = await call(one, "POST", "/v1/conversations", {})
            path = f"/v1/conversations/{conv['id']}/items"

            def pair(n: int) -> dict[str, Any]:
                return {"items": [{**HELLO, "id": f"a{n}"}, {**HELLO, "id": f"b{n}"}]}

            # When 40 requests of two items each go to two gateways at once
            answers = await asyncio.gather(*(call((one, two)[n % 2], "POST", path, pair(n))
                                             for n in range(40)))  # fmt: skip
            assert all(status == 200 for status, _ in answers)
            # Then the conversation holds all 80, each pair together and in its order
            ids: list[str] = []
            after = ""
            for _ in range(4):  # 80 items: 3 pages of 30
                _, page = await call(two, "GET", f"{path}?order=asc&limit=30{after}")
                ids += [i["id"] for i in page["data"]]
                if not page["has_more"]:
                    break
                after = f"&after={page['last_id']}"
            assert len(ids) == 80 and {ids[i][1:] for i in range(0, 80, 2)} == {
                str(n) for n in range(40)}  # fmt: skip
            assert all(ids[i] == f"a{ids[i][1:]}" and ids[i + 1] == f"b{ids[i][1:]}"
                       for i in range(0, 80, 2))  # fmt: skip

    asyncio.run(go())


def test_items_are_stored_and_shown_as_openai_answers_them() -> None:
    from batchfleet.producer.gateway.conversation_routes import new_items, shown

    user, assistant, call = new_items([HELLO, {"role": "assistant", "content": "Hi"},
                                       {"type": "function_call", "call_id": "c", "name": "f",
                                        "arguments": "{}"}])  # fmt: skip
    assert user["content"] == [{"type": "input_text", "text": "hello"}]
    assert (user["type"], user["status"], user["id"][:4]) == ("message", "completed", "msg_")
    assert assistant["content"] == [{"type": "output_text", "text": "Hi", "annotations": []}]
    assert call["id"].startswith("fc_") and "status" not in call and user["id"] != assistant["id"]
    # an output text's log-probabilities only where include asks for them
    part = {"type": "output_text", "text": "Hi", "logprobs": [{"token": "Hi", "logprob": -1.0}]}
    item = {**assistant, "content": [part]}
    assert shown(item, True) == item
    assert shown(item, False)["content"] == [{**part, "logprobs": []}]
