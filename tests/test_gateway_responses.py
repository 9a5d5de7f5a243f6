"""OpenAI's Responses API (``POST /v1/responses``) in the gateway.

Units: the request's translation into the chat the fleet generates (checked by the
producer's own validation), results → ``response`` objects and deltas → the stream's events
(each checked against the ``openai`` client's own pydantic types, and the stream against
the client's event accumulator). End to end: the official ``openai`` client → a real
gateway process → Redis → a real worker with a tiny random Llama, compared with the same
chat sent through the Python producer (greedy: the same text)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import openai
import pydantic
import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.aio import AsyncProducer
from batchfleet.producer.gateway.app import Gateway, make_app
from batchfleet.producer.gateway.endpoint import Answered
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.gateway.replay import Diverged
from batchfleet.producer.gateway.response_input import response_submission
from batchfleet.producer.gateway.responses import ResponseEvents, response
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.errors import RequestRejected
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Delta, Result
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from test_gateway import LM, Fleet, leave_mid_stream, producer_text, serving
from test_gateway_replies import Worker
from test_gateway_units import built

from batchfleet.redis_server import free_port

pytestmark = pytest.mark.timeout(240)

ANSWERED = Answered("resp_r1", 1700000000)
EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}  # fmt: skip


# --- the request -----------------------------------------------------------------------


def test_a_responses_body_becomes_the_chat_it_means() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city":"Rome"}', "id": "fc_call_1", "status": "completed"}  # fmt: skip
    body = {
        "model": "lm", "instructions": "be brief", "max_output_tokens": 30, "temperature": 0.5,
        "top_p": 0.9, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "reasoning": {"effort": "low"}, "metadata": {"a": "b"},
        "user": "u", "store": True, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
        "input": [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "let me look", "annotations": []}]},
            call,
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
    }  # fmt: skip
    request = built(response_submission(body))
    msgs = request.messages
    assert [m.role for m in msgs] == ["system", "system", "user", "assistant", "tool"]
    assert msgs[0].content == "be brief" and msgs[2].content == "a\nb"
    assert msgs[3].content == "let me look" and msgs[3].tool_calls is not None
    (past,) = msgs[3].tool_calls
    assert (past.id, past.function.name, past.function.arguments) == (
        "call_1", "get_weather", '{"city":"Rome"}')  # fmt: skip
    assert msgs[4].tool_call_id == "call_1" and msgs[4].content == "sunny"
    assert request.max_new_tokens == 30 and request.temperature == 0.5 and request.top_p == 0.9
    assert request.tools is not None and request.tools[0].function.name == "get_weather"
    assert request.tool_choice.function.name == "get_weather"
    assert request.parallel_tool_calls is False and request.reasoning_effort == "low"
    assert request.logprobs == 2
    # a text input is one user message; a function call with no message before it opens one
    plain = built(response_submission({"model": "lm", "input": "hi"}))
    assert [(m.role, m.content) for m in plain.messages] == [("user", "hi")]
    alone = built(response_submission({"model": "lm", "input": [call, {
        "type": "function_call_output", "call_id": "call_1", "output": [
            {"type": "input_text", "text": "rain"}]}]}))  # fmt: skip
    assert alone.messages[0].tool_calls and alone.messages[1].content == "rain"
    # text.format is chat's response_format
    assert built(response_submission({"model": "lm", "input": "x", "text": {
        "format": {"type": "json_object"}}})).response_format.type == "json_object"  # fmt: skip
    schema = built(response_submission({"model": "lm", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}}}))  # fmt: skip
    assert schema.response_format.type == "json_schema"
    assert schema.response_format.json_schema.json_schema == {"type": "object"}
    assert built(response_submission({"model": "lm", "input": "x", "text": {
        "format": {"type": "text"}}})).response_format is None  # fmt: skip


def test_an_assistant_turn_spans_its_reasoning_message_and_calls_as_vllm_s() -> None:
    def reasoning(text: str, field: str = "content") -> dict[str, Any]:
        kind = "reasoning_text" if field == "content" else "summary_text"
        return {"type": "reasoning", "summary": [], field: [{"type": kind, "text": text}]}

    def said(text: str) -> dict[str, Any]:
        return {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip

    def call(n: int) -> dict[str, Any]:
        return {"type": "function_call", "call_id": f"call_{n}", "name": "get_weather",
                "arguments": '{"city":"Rome"}'}  # fmt: skip

    def turns(*items: dict[str, Any]) -> list[tuple[Any, ...]]:
        request = built(response_submission({"model": "lm", "tools": [WEATHER],
                                             "input": [{"role": "user", "content": "q"}, *items]}))  # fmt: skip
        return [(m.role, m.content, m.reasoning_content,
                 [c.id for c in m.tool_calls] if m.tool_calls else None) for m in request.messages]  # fmt: skip

    user = ("user", "q", None, None)
    # a response's output, in its order: one assistant turn (vLLM's merging)
    assert turns(reasoning("R"), said("C"), call(1), call(2)) == [
        user, ("assistant", "C", "R", ["call_1", "call_2"])]  # fmt: skip
    # a call, then its output, then more reasoning: a turn of its own, with no text
    done = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    assert turns(reasoning("R"), call(1), done, reasoning("S", "summary")) == [
        user, ("assistant", None, "R", ["call_1"]), ("tool", "sunny", None, None),
        ("assistant", "", "S", None)]  # fmt: skip
    # a second reasoning, or a second message, begins a turn (each turn has one of each)
    assert turns(said("A"), reasoning("R"), reasoning("S"), said("B"), said("C")) == [
        user, ("assistant", "A", "R", None), ("assistant", "B", "S", None),
        ("assistant", "C", None, None)]  # fmt: skip
    # its content's text over its summary's; neither: empty reasoning (as vLLM reads them)
    both = reasoning("R") | {"summary": [{"type": "summary_text", "text": "S"}]}
    assert turns(both, said("C")) == [user, ("assistant", "C", "R", None)]
    assert turns({"type": "reasoning", "summary": []}, said("C")) == [
        user,
        ("assistant", "C", "", None),
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]},
         "input[0].encrypted_content"),
        ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 3}]}]},
         "input[0].content[0].text"),
        ({"input": [{"type": "reasoning", "summary": "hm"}]}, "input[0].summary"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"model": None}, "model"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_what_is_refused_before_submitting(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        response_submission({"model": "lm", "input": "hi"} | extra)
    assert e.value.status == 400 and e.value.param == param


def test_bad_values_are_the_producers_to_refuse() -> None:
    for extra in ({"temperature": -1}, {"max_output_tokens": -1}, {"reasoning": {"effort": "x"}}):
        with pytest.raises(RequestRejected):
            built(response_submission({"model": "lm", "input": "hi"} | extra))


# --- the answers -----------------------------------------------------------------------


def result(output: dict[str, Any], **more: Any) -> Result:
    return Result.model_validate({"id": "r1", "model": "lm", "status": "ok", "outputs": [output],
                                  "usage": {"prompt_tokens": 7, "completion_tokens": 5,
                                            "prompt_tokens_details": {"cached_tokens": 3}},
                                  "finished_at_ms": 1700000001000, **more})  # fmt: skip


CALL = {"id": "call_9", "type": "function", "function": {"name": "get_weather",
                                                        "arguments": '{"city":"Paris"}'}}  # fmt: skip
LP = {
    "token": 5,
    "text": "hi",
    "logprob": -0.5,
    "top": [{"token": 5, "text": "hi", "logprob": -0.5}],
}


def test_a_whole_response() -> None:
    body = {"model": "lm", "input": "x", "instructions": "be", "tools": [WEATHER],
            "metadata": {"k": "v"}, "max_output_tokens": 5, "include": [
                "message.output_text.logprobs"]}  # fmt: skip
    out = response(body, result({"text": "<think>hm</think>hi<tool_call>...",
                                 "finish_reason": "stop", "content": "hi", "logprobs": [LP],
                                 "reasoning_content": "hm", "tool_calls": [CALL]}), ANSWERED)  # fmt: skip
    r = Response.model_validate(out)  # the openai client's own types, validated
    assert r.id == "resp_r1" and r.status == "completed" and r.output_text == "hi"
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "hm" and reasoning.id == "rs_r1"
    assert message.type == "message" and message.id == "msg_r1"
    assert message.content[0].type == "output_text" and message.content[0].logprobs is not None
    assert message.content[0].logprobs[0].bytes == [104, 105]
    assert call.type == "function_call" and (call.call_id, call.name, call.id) == (
        "call_9", "get_weather", "fc_call_9")  # fmt: skip
    assert r.usage is not None and r.usage.input_tokens_details.cached_tokens == 3
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (7, 5, 12)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # the request's settings echoed
    assert r.instructions == "be" and r.metadata == {"k": "v"} and r.max_output_tokens == 5
    assert r.tools[0].type == "function" and r.tool_choice == "auto" and r.parallel_tool_calls
    assert r.temperature == 0.0 and r.top_p == 1.0 and r.completed_at == 1700000001.0
    # cut by max_output_tokens: incomplete; only calls make no message
    cut = Response.model_validate(response({"input": "x"}, result({"text": "ab",
                                           "finish_reason": "length"}), ANSWERED))  # fmt: skip
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.completed_at is None
    assert cut.output[0].type == "message" and cut.output[0].status == "incomplete"
    calls = response({}, result({"text": "[...]", "finish_reason": "stop", "content": "",
                                 "tool_calls": [CALL]}), ANSWERED)  # fmt: skip
    assert [i["type"] for i in calls["output"]] == ["function_call"]


def delta(seq: int, text: str, **more: Any) -> Delta:
    return Delta(id="r1", seq=seq, text=text, tokens=1, **more)


def replay(events: list[dict[str, Any]], body: dict[str, Any] | None = None) -> Any:
    """The events as the openai client's stream helper reads them (each validated, then
    accumulated with its checks), and the response of the last."""
    state: Any = ResponseStreamState(input_tools=body.get("tools", []) if body else [],
                                     text_format=openai.omit)  # fmt: skip
    read = [out for e in events for out in state.handle_event(EVENT.validate_python(e))]
    return read[-1].response


def test_a_stream_of_text_with_a_restart() -> None:
    s = ResponseEvents({"input": "x"}, ANSWERED, "lm")
    assert s.feed(delta(1, "")) == []  # nothing to show yet: nothing sent
    first = s.feed(delta(2, "Hel"))
    assert [e["type"] for e in first] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta"]  # fmt: skip
    assert first[0]["response"]["status"] == "in_progress" and first[-1]["delta"] == "Hel"
    assert first[-1]["item_id"] == "msg_r1" and first[-1]["logprobs"] == []
    more = s.feed(delta(3, "lo"))
    # Restarted: the same deltas again are skipped, then new ones go on
    assert s.feed(Restarted("r1")) == []
    assert s.feed(delta(1, "")) == s.feed(delta(2, "Hel")) == s.feed(delta(3, "lo")) == []
    (bang,) = s.feed(delta(4, "!"))
    end = s.finish(result({"text": "Hello!", "finish_reason": "stop"}))
    assert [e["type"] for e in end] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]  # fmt: skip
    events = first + more + [bang] + end
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = replay(events)
    assert final.output_text == "Hello!" and final.status == "completed"
    assert final.output[0].id == "msg_r1" and end[-1]["response"]["usage"]["total_tokens"] == 12
    # and a regeneration that differs from what was sent ends the stream
    s.feed(Restarted("r1"))
    with pytest.raises(Diverged):
        s.feed(delta(1, "Help"))


def test_a_stream_of_reasoning_calls_and_a_late_text() -> None:
    body = {"input": "x", "tools": [WEATHER], "include": ["message.output_text.logprobs"]}
    s = ResponseEvents(body, ANSWERED, "lm")
    opening = {"index": 0, "id": "call_9", "type": "function",
               "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    events = s.feed(delta(1, "<think>hm", content="", reasoning_content="hm"))
    events += s.feed(delta(2, "</think><tool_call>{", content="", tool_call_chunks=[opening]))
    events += s.feed(delta(3, '"city":"Paris"}', content="", tool_call_chunks=[
        {"index": 0, "function": {"arguments": '{"city":'}}]))  # fmt: skip
    # a second call the model began and did not finish: closed incomplete, left out
    events += s.feed(delta(4, "<tool_call>", content="", tool_call_chunks=[
        {"index": 1, "id": "call_bad", "type": "function", "function": {"name": "get_weather"}}]))  # fmt: skip
    events += s.feed(delta(5, "ok", content="", logprobs=[LP]))  # its logprobs held
    end = s.finish(result({"text": "...", "finish_reason": "length", "content": "ok",
                           "reasoning_content": "hm", "tool_calls": [CALL], "logprobs": [LP]}))  # fmt: skip
    events += end
    types = [e["type"] for e in events]
    assert types.count("response.reasoning_text.delta") == 1
    assert [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
            ] == ['{"city":', '"Paris"}']  # fmt: skip
    assert types[-1] == "response.incomplete"
    # the text the deltas did not carry is opened at the end and sent whole
    (text,) = [e for e in events if e["type"] == "response.output_text.delta"]
    assert text["delta"] == "ok" and text["output_index"] == 3
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [
        ("reasoning", "incomplete"), ("function_call", "completed"),
        ("function_call", "incomplete"), ("message", "incomplete")]  # fmt: skip
    final = replay(events, body)
    assert final.status == "incomplete" and final.output_text == "ok"
    assert [i.type for i in final.output] == ["reasoning", "function_call", "message"]
    assert final.output[1].arguments == '{"city":"Paris"}'
    assert final.output[2].content[0].logprobs[0].token == "hi"


@contextlib.asynccontextmanager
async def live(redis_url: str) -> AsyncIterator[tuple[Gateway, str, int]]:
    """A gateway listening on a free port, subscribed to its replies: it, the reply
    channel its workers publish on, and its port."""
    async with AsyncProducer(redis_url) as p:
        gateway = Gateway(p)
        gateway.replies.start()
        await gateway.replies.subscribed.wait()
        port = free_port()
        server = make_app(gateway, {}).listen(port, "127.0.0.1")
        try:
            yield gateway, p.reply_channel, port
        finally:
            server.stop()
            await gateway.replies.close()
            await asyncio.gather(*gateway.pending)


@contextlib.asynccontextmanager
async def posted(
    redis_url: str, body: Mapping[str, Any], rid: str
) -> AsyncIterator[tuple[str, asyncio.StreamReader]]:
    """``body`` POSTed to ``/v1/responses`` of a gateway on a free port as request ``rid``,
    once submitted: the reply channel its workers publish on and the answer's reader."""
    async with live(redis_url) as (gateway, channel, port):
        raw = json.dumps(body).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/responses HTTP/1.0\r\nX-Request-Id: %s\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (rid.encode(), len(raw), raw))  # fmt: skip
        while not gateway.inflight:  # submitted, its stream taken
            await asyncio.sleep(0.01)
        try:
            yield channel, reader
        finally:
            writer.close()


def test_a_stream_that_breaks_after_it_began_ends_with_an_error_event(
    redis_url: str, r: redis.Redis
) -> None:
    keys = ModelKeys("m")
    r.set(keys.lanes_key, 3)  # a worker of "m" started (none runs: its deltas are written here)

    async def go() -> list[tuple[str, dict[str, Any]]]:
        body = {"model": "m", "input": "x", "stream": True}
        async with posted(redis_url, body, "rs-1") as (channel, reader):
            # Given a stream that began, When its worker dies and the heir writes other text
            worker = Worker(r, channel, "rs-1")
            worker.delta(1, "Hel")
            while (line := await reader.readline()) and b"output_text.delta" not in line:
                pass
            worker.delta(1, "Help")
            raw = await reader.read()
            return [(e.split("\n")[0][7:], json.loads(e.split("\n")[1][6:]))
                    for e in raw.decode().split("\n\n") if e.startswith("event: ")]  # fmt: skip

    events = asyncio.run(go())
    # Then the stream ends with OpenAI's error event, numbered after the others
    kind, error = events[-1]
    assert kind == error["type"] == "error" and error["code"] == "stream_restarted"
    assert error["sequence_number"] == 5  # created, in_progress, added, part added, delta
    assert EVENT.validate_python(error).type == "error"
    assert r.exists(keys.cancel("rs-1"))  # and the fleet stops generating it


# --- end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with serving(tmp_path_factory.mktemp("responses")) as fleet:
        yield fleet


def test_text_whole_and_streamed_is_the_producers(fleet: Fleet) -> None:
    # Given a chat's greedy text through the Python producer
    expected = producer_text(fleet, messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Tell me\na story"}],
                             max_new_tokens=24, ignore_eos=True)  # fmt: skip
    ask: dict[str, Any] = {
        "model": LM, "instructions": "Be brief.", "max_output_tokens": 24,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Tell me"},
                                               {"type": "input_text", "text": "a story"}]}],
        "extra_body": {"ignore_eos": True}, "metadata": {"run": "1"},
    }  # fmt: skip
    # When the openai client asks the gateway for the same, whole
    raw = fleet.client.responses.with_raw_response.create(**ask)
    whole = raw.parse()
    # Then it is the same text, cut by max_output_tokens: incomplete
    assert whole.output_text == expected and whole.object == "response"
    assert whole.id == f"resp_{raw.headers['x-request-id']}"
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 24
    assert whole.usage.total_tokens == whole.usage.input_tokens + 24 > 24
    assert whole.instructions == "Be brief." and whole.metadata == {"run": "1"}
    # and streamed, the deltas add up to it, numbered, from created to incomplete
    events = list(fleet.client.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.output_text == expected
    # and the client's stream helper reads the same (its final response is a completed one:
    # an incomplete response is the last event's)
    with fleet.client.responses.stream(**ask) as stream:
        read = list(stream)
    assert read[-1].type == "response.incomplete"
    texts = [e.delta for e in read if e.type == "response.output_text.delta"]
    assert "".join(texts) == read[-1].response.output_text == expected
    # and a request id chosen by the client answers the same single result when sent again
    rid = uuid.uuid4().hex
    sampled = ask | {"temperature": 1.0, "extra_headers": {"X-Request-Id": rid}}
    first = fleet.client.responses.create(**sampled)
    again = fleet.client.responses.create(**sampled)
    assert first.id == again.id == f"resp_{rid}" and first.output_text == again.output_text


def test_a_function_call_round_trip(fleet: Fleet) -> None:
    # Given a function tool that must be called (the grammar makes the random model call it)
    ask: dict[str, Any] = {"model": LM, "input": "weather?", "tools": [WEATHER],
                           "tool_choice": "required", "parallel_tool_calls": False,
                           "max_output_tokens": 200}  # fmt: skip
    whole = fleet.client.responses.create(**ask)
    # Then the answer is one function_call item with the call's arguments
    (call,) = [i for i in whole.output if i.type == "function_call"]
    assert whole.status == "completed" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # and streamed, the arguments' deltas add up to the same call
    with fleet.client.responses.stream(**ask) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = [i for i in final.output if i.type == "function_call"]
    assert "".join(pieces) == streamed.arguments == call.arguments and streamed.name == call.name
    # When the call and its output go back as input items
    back = fleet.client.responses.create(model=LM, max_output_tokens=6, tools=[WEATHER],
                                         input=[{"role": "user", "content": "weather?"},
                                                call.model_dump(exclude_none=True),
                                                {"type": "function_call_output",
                                                 "call_id": call.call_id, "output": "sunny"}])  # type: ignore[list-item]  # fmt: skip
    # Then the model answers the chat that holds them, as the producer sends it: the same
    # prompt (its tokens) and the same answer
    with Producer(fleet.url) as p:
        (expected,) = p.submit(LM, max_new_tokens=6, tools=[{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
             "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        ).result(timeout=120).generations()  # fmt: skip
    assert back.usage is not None and back.usage.input_tokens == expected.prompt_tokens
    assert (
        back.output_text == expected.content
        and back.usage.output_tokens == expected.completion_tokens
    )


def test_a_two_turn_conversation_through_previous_response_id(fleet: Fleet) -> None:
    c = fleet.client
    # Given a first turn, stored
    first = c.responses.create(model=LM, input="Tell me a story", max_output_tokens=8)
    assert first.store and first.output_text
    # When the next turn continues it
    second = c.responses.create(model=LM, input="And then?", max_output_tokens=8,
                                previous_response_id=first.id)  # fmt: skip
    # Then the model answered the whole chat, as the producer sends it: the same prompt
    # (its tokens) and the same (greedy) answer
    with Producer(fleet.url) as p:
        (expected,) = p.submit(LM, max_new_tokens=8, messages=[
            {"role": "user", "content": "Tell me a story"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}]).result(timeout=120).generations()  # fmt: skip
    assert second.usage is not None and second.usage.input_tokens == expected.prompt_tokens
    assert second.output_text == expected.text and second.previous_response_id == first.id
    # and any gateway reads it back
    again = c.responses.retrieve(second.id)
    assert again.output_text == second.output_text and again.usage == second.usage
    with pytest.raises(openai.NotFoundError) as unknown:
        c.responses.create(model=LM, input="x", previous_response_id="resp_unknown")
    assert unknown.value.param == "previous_response_id"


def test_a_background_response_polled_until_done(fleet: Fleet) -> None:
    c = fleet.client
    ask: dict[str, Any] = {"model": LM, "input": "Tell me a story", "max_output_tokens": 8}
    # Given the answer waited for
    waited = c.responses.create(**ask)
    # When the same is asked in the background
    made = c.responses.create(**ask, background=True)
    assert made.status in ("queued", "completed") and made.background
    # Then polling it ends with the same answer (greedy), stored
    deadline = time.monotonic() + 120
    polled = made
    while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        polled = c.responses.retrieve(made.id)
    assert polled.status == waited.status and polled.output_text == waited.output_text
    assert polled.usage is not None and waited.usage is not None
    assert polled.usage.input_tokens == waited.usage.input_tokens  # cached_tokens may differ
    assert polled.usage.output_tokens == waited.usage.output_tokens
    assert polled.background and polled.store and polled.id == made.id
    # and a finished one cannot be cancelled
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(made.id)


def test_a_background_stream_left_resumed_and_cancelled(fleet: Fleet) -> None:
    c = fleet.client
    # Given a long background response streamed, left once its text flows
    stream = c.responses.create(model=LM, input="the cat", max_output_tokens=4000,
                                background=True, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    seen: list[Any] = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()
    rid = seen[0].response.id
    assert [e.type for e in seen[:3]] == ["response.created", "response.queued",
                                          "response.in_progress"]  # fmt: skip
    # Then the worker goes on generating it: in progress, not cancelled
    assert c.responses.retrieve(rid).status == "in_progress"
    # When the client resumes after the last event it read, and cancels it mid-stream
    resumed = c.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number)
    rest: list[Any] = []
    for event in resumed:
        rest.append(event)
        if sum(e.type == "response.output_text.delta" for e in rest) == 3:
            assert c.responses.cancel(rid).status == "cancelled"
    # Then the stream goes on without a gap to the response cancelled, with the text streamed
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))
    end = rest[-1]
    assert end.type == "response.incomplete" and end.response.status == "cancelled"
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert end.response.output_text == text == c.responses.retrieve(rid).output_text
    assert end.response.usage is not None and 3 < end.response.usage.output_tokens < 4000


def test_text_format_json_schema(fleet: Fleet) -> None:
    schema = {"enum": ["yes", "no"]}
    reply = fleet.client.responses.create(
        model=LM, input="json", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})  # fmt: skip
    assert reply.status == "completed" and json.loads(reply.output_text) in ("yes", "no")
    assert reply.text is not None and reply.text.format is not None
    assert reply.text.format.type == "json_schema"


def test_refusals_are_openai_errors(fleet: Fleet) -> None:
    c = fleet.client
    for extra, param in (({"background": True, "store": False}, "store"),
                         ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                         ({"max_output_tokens": -1}, "max_output_tokens"),
                         ({"temperature": -1}, "temperature")):  # fmt: skip
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as bad:
                out = c.responses.create(model=LM, input="x", stream=stream, **extra)
                list(out) if stream else None  # type: ignore[call-overload]
            assert bad.value.param == param
    assert "temperature" in str(bad.value) and bad.value.code == "invalid_request"
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="x")
    # a refusal the worker answers (a prompt over its bound) before any event: 400
    with pytest.raises(openai.BadRequestError) as big:
        list(c.responses.create(model=LM, input="the cat " * 1200, stream=True))
    assert big.value.code == "too_large"


def test_a_client_that_leaves_mid_stream_cancels_its_request(fleet: Fleet) -> None:
    body = {"model": LM, "input": "the cat", "max_output_tokens": 4000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    # Given a long streamed response, read until its text flows, When the client closes
    # the connection
    out = leave_mid_stream(fleet, "/v1/responses", body,
                           lambda line: line == b"event: response.output_text.delta\n")  # fmt: skip
    # Then the fleet stops it: cancelled, short
    assert out["finish_reason"] == "cancelled" and out["completion_tokens"] < 4000
