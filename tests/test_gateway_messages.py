"""Anthropic's Messages API on the gateway (``POST /v1/messages``): the translation and the
event stream without a server, then end to end with the official `anthropic` client →
`batchfleet gateway` (a real process) → Redis → a real worker generating with a tiny
random Llama, compared with the same chats sent through the Python producer (greedy
decoding: the same text)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from batchfleet.producer import Producer
from batchfleet.producer.gateway.anthropic_answers import error_body, message
from batchfleet.producer.gateway.anthropic_events import MessageEvents
from batchfleet.producer.gateway.anthropic_fields import submission
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.gateway.replay import Diverged
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.errors import RequestRejected
from batchfleet.schemas.messages import Delta, Generation, Result
from pydantic import TypeAdapter
from test_gateway import KEY, LM, Fleet, leave_mid_stream, serving
from test_gateway_units import built

WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}  # fmt: skip
EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}: "
    "{{ t['function']['description'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% if enable_thinking is defined %}<|im_start|>system\nthink {{ enable_thinking }}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %} call {{ c['function']['name'] }}"
    " {{ c['function']['arguments']['city'] }}{% endfor %}{% if m.get('tool_call_id') %}"
    " for {{ m['tool_call_id'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML that renders the tools, earlier calls, the tool turns' call ids and
``enable_thinking`` (so that a prompt's size shows they were sent)."""

# --- the translation -----------------------------------------------------------------------


def test_a_messages_body_becomes_the_fleets_chat() -> None:
    body = {
        "model": "lm", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "stop_sequences": ["END"], "metadata": {"user_id": "u1"}, "service_tier": "auto",
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                   {"type": "text", "text": "Be kind."}, {"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "down"}]},
                {"type": "text", "text": "and?"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]},
        ],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},
    }  # fmt: skip
    sub = submission(body)
    request = built(sub)
    assert request.max_new_tokens == 9 and request.stop == ["END"] and request.top_k == 5
    assert (request.temperature, request.top_p) == (0.5, 0.9)
    assert request.tool_choice == "required" and request.parallel_tool_calls is False
    assert request.chat_template_kwargs == {"enable_thinking": False}
    (tool,) = request.tools
    assert tool.function.parameters == WEATHER["input_schema"]
    assert tool.function.description == "The weather in a city"
    got = [m.model_dump(exclude_none=True) for m in request.messages]
    assert got == [
        {"role": "system", "content": "Be kind.\nBe brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: down"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "tool_calls": [{"id": "toolu_2", "type": "function",
                                              "function": {"name": "get_weather",
                                                           "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": ""},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("choice", "tools", "expected"),
    [
        ({"type": "auto"}, True, {"tool_choice": "auto"}),
        ({"type": "any"}, True, {"tool_choice": "required"}),
        ({"type": "none"}, True, {"tool_choice": "none"}),
        ({"type": "tool", "name": "get_weather"}, True,
         {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ({"type": "auto"}, False, {}),  # without tools, auto and none say nothing
        ({"type": "none", "disable_parallel_tool_use": True}, False, {}),
    ],
)  # fmt: skip
def test_tool_choice(choice: dict[str, Any], tools: bool, expected: dict[str, Any]) -> None:
    body = {"model": "lm", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "tool_choice": choice} | ({"tools": [WEATHER]} if tools else {})  # fmt: skip
    options = submission(body).options
    assert {k: options[k] for k in ("tool_choice", "parallel_tool_calls") if k in options} == (
        expected | ({"parallel_tool_calls": False} if "disable_parallel_tool_use" in choice
                    else {}))  # fmt: skip
    built(submission(body))  # the producer takes it


def test_thinking_extras_and_output_config() -> None:
    base = {"model": "lm", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    on = submission(base | {"thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert on.options["chat_template_kwargs"] == {"enable_thinking": True}
    # the client's own chat_template_kwargs (vLLM's extra) win
    mine = submission(base | {"thinking": {"type": "enabled", "budget_tokens": 1024},
                              "chat_template_kwargs": {"enable_thinking": False, "k": 1}})  # fmt: skip
    assert mine.options["chat_template_kwargs"] == {"enable_thinking": False, "k": 1}
    extras = built(submission(base | {"seed": 3, "ignore_eos": True, "priority": 0, "n": 4}))
    assert extras.seed == 3 and extras.ignore_eos is True and extras.n in (None, 1)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = built(submission(base | {"output_config": {
        "format": {"type": "json_schema", "schema": schema}, "effort": "low"}}))  # fmt: skip
    assert fmt.response_format.json_schema.json_schema == schema
    assert fmt.reasoning_effort == "low"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
         "messages[0].content[1]"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                     "content": [{"type": "image"}]}]}]},
         "messages[0].content[0].content[0]"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                          "name": "f", "input": [1]}]}]},
         "messages[0].content[0].input"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tools": {"name": "f"}}, "tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "maybe"}}, "thinking.type"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ],
)  # fmt: skip
def test_bodies_refused_before_the_fleet(change: dict[str, Any], param: str) -> None:
    body = {"model": "lm", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ApiError) as e:
        submission({**body, **change})
    assert e.value.status == 400 and e.value.param == param


def test_values_the_fleet_refuses_are_the_producers_to_tell() -> None:
    body = {"model": "lm", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    for change in ({"temperature": -1}, {"max_tokens": -1},
                   {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}):  # fmt: skip
        with pytest.raises(RequestRejected):
            built(submission(body | change))
    # 0, which the fleet takes (the prompt only), is refused as Anthropic's API does
    with pytest.raises(ApiError) as e:
        submission(body | {"max_tokens": 0})
    assert e.value.param == "max_tokens"


# --- answers, events, errors ---------------------------------------------------------------


def result(output: dict[str, Any], **usage: Any) -> Result:
    return Result.model_validate({"id": "r1", "model": "lm", "status": "ok", "outputs": [output],
                                  "usage": usage or {"prompt_tokens": 7, "completion_tokens": 3}})  # fmt: skip


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}  # fmt: skip


def test_a_whole_answer_is_a_message_the_sdk_reads() -> None:
    res = result({"text": "<think>hm</think>Rome.<tool_call>...", "finish_reason": "stop",
                  "reasoning_content": "hm", "content": "Rome.", "tool_calls": [CALL]},
                 prompt_tokens=10, completion_tokens=4,
                 prompt_tokens_details={"cached_tokens": 6})  # fmt: skip
    out = message(res, "msg_r1")
    parsed = Message.model_validate(out)
    assert [b.type for b in parsed.content] == ["thinking", "text", "tool_use"]
    assert out["content"][2] == {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                 "input": {"city": "Rome"}}  # fmt: skip
    assert parsed.stop_reason == "tool_use" and parsed.stop_sequence is None
    assert out["usage"] == {"input_tokens": 4, "output_tokens": 4,
                            "cache_read_input_tokens": 6, "cache_creation_input_tokens": 0}  # fmt: skip
    assert (parsed.id, parsed.model, parsed.role) == ("msg_r1", "lm", "assistant")


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        ({"text": "a", "finish_reason": "stop"}, "end_turn"),
        ({"text": "a", "finish_reason": "length"}, "max_tokens"),
        ({"text": "", "finish_reason": "stop", "content": "", "tool_calls": [CALL]}, "tool_use"),
        ({"text": "a", "finish_reason": "deadline"}, "deadline"),
        ({"text": "a", "finish_reason": "cancelled"}, "cancelled"),
        ({"text": "a", "finish_reason": "stop", "stop_reason": "END"}, "stop_sequence"),
        ({"text": "a", "finish_reason": "stop", "stop_reason": 2}, "end_turn"),
    ],
)  # fmt: skip
def test_stop_reasons(output: dict[str, Any], reason: str) -> None:
    out = message(result(output), "msg_r1")
    assert out["stop_reason"] == reason
    # the stop string that ended it, for stop_sequence only
    assert out["stop_sequence"] == ("END" if reason == "stop_sequence" else None)
    if reason not in ("deadline", "cancelled"):  # the fleet's own: not the SDK's
        assert Message.model_validate(out).stop_reason == reason
    events = MessageEvents("msg_r1", "lm").finish(result(output))
    assert events[-2]["delta"] == {"stop_reason": reason, "stop_sequence": out["stop_sequence"]}
    assert [b["type"] for b in out["content"]] == (["tool_use"] if "tool_calls" in output
                                                   else ["text"])  # fmt: skip


def delta(seq: int, text: str, **more: Any) -> Delta:
    return Delta(id="r1", seq=seq, text=text, tokens=1, **more)


def test_stream_events_blocks_in_turn_and_a_restart() -> None:
    ev = MessageEvents("msg_r1", "lm")
    start = ev.feed(delta(1, "<think>", reasoning_content="", content="", prompt_tokens=12))
    assert [e["type"] for e in start] == ["message_start"]
    assert start[0]["message"]["usage"]["input_tokens"] == 12  # as the first delta tells
    assert start[0]["message"]["content"] == [] and start[0]["message"]["stop_reason"] is None
    out = ev.feed(delta(2, "hm", reasoning_content="hm", content=""))
    out += ev.feed(delta(3, "</think>Ro", reasoning_content="", content="Ro"))
    out += ev.feed(delta(4, "me.", content="me."))
    # a restart: the same deltas again are skipped, then the new ones go on
    assert ev.feed(Restarted("r1")) == []
    assert all(ev.feed(d) == [] for d in (
        delta(1, "<think>", reasoning_content="", content=""),
        delta(2, "hm", reasoning_content="hm", content=""),
        delta(3, "</think>Ro", reasoning_content="", content="Ro"),
        delta(4, "me.", content="me.")))  # fmt: skip
    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    out += ev.feed(delta(5, "<tool_call>", content="", tool_call_chunks=[first]))
    out += ev.feed(delta(6, '{"city":"Rome"}', content="", tool_call_chunks=[
        {"index": 0, "function": {"arguments": '{"city":'}},
        {"index": 0, "function": {"arguments": '"Rome"}'}}]))  # fmt: skip
    out += ev.finish(result({"text": "...", "finish_reason": "stop", "content": "Rome.",
                             "reasoning_content": "hm", "tool_calls": [CALL]}))  # fmt: skip
    for e in start + out:
        EVENTS.validate_python(e)  # each is one of the SDK's events
    shape = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {})
              .get("type")) for e in out]  # fmt: skip
    assert shape == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]  # fmt: skip
    assert out[7]["content_block"] == {"type": "tool_use", "id": "call_1",
                                       "name": "get_weather", "input": {}}  # fmt: skip
    assert "".join(e["delta"].get("partial_json", "") for e in out[8:10]) == '{"city":"Rome"}'
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"]["output_tokens"] == 3 and out[-2]["usage"]["input_tokens"] == 7
    # and a regeneration that differs from what was sent ends the stream
    ev.feed(Restarted("r1"))
    with pytest.raises(Diverged):
        ev.feed(delta(1, "<thunk>"))


def test_a_stream_with_no_delta_still_opens_and_closes() -> None:
    ev = MessageEvents("msg_r1", "lm")
    out = ev.finish(result({"text": "", "finish_reason": "length"}))
    assert [e["type"] for e in out] == ["message_start", "message_delta", "message_stop"]


def sdk_stream(events: list[dict[str, Any]]) -> anthropic.Stream[Any]:
    """The SDK's reading of these events as the gateway writes them."""
    raw = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
    response = httpx2.Response(200, content=raw, headers={"content-type": "text/event-stream"},
                               request=httpx2.Request("POST", "http://gw/v1/messages"))  # fmt: skip
    client = anthropic.Anthropic(api_key="k", base_url="http://gw")
    return anthropic.Stream(cast_to=RawMessageStreamEvent, response=response, client=client)


def test_errors_in_anthropics_shape() -> None:
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"),
                         (404, "not_found_error"), (429, "rate_limit_error"),
                         (500, "api_error"), (503, "overloaded_error"), (504, "timeout_error")):  # fmt: skip
        assert error_body(ApiError(status, "why")) == {
            "type": "error", "error": {"type": kind, "message": "why"}}  # fmt: skip
    # an error after the stream began is an `error` event, which the SDK raises
    ev = MessageEvents("msg_r1", "lm")
    events = [*ev.feed(delta(1, "Hel")), error_body(ApiError(500, "stream restarted"))]
    with pytest.raises(anthropic.APIStatusError) as e:
        list(sdk_stream(events))
    assert e.value.body == {"type": "error",
                            "error": {"type": "api_error", "message": "stream restarted"}}  # fmt: skip


# --- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with serving(tmp_path_factory.mktemp("messages"), template=TEMPLATE) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> anthropic.Anthropic:
    """Anthropic's official client of the gateway (its key sent as x-api-key)."""
    return anthropic.Anthropic(base_url=fleet.base, api_key=KEY, max_retries=0, timeout=120)


def produced(fleet: Fleet, **options: Any) -> Generation:
    with Producer(fleet.url) as p:
        (g,) = p.submit(LM, **options).result(timeout=120).generations()
        return g


def text(msg: Message) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


@pytest.mark.timeout(240)
def test_whole_and_streamed_match_the_producer(fleet: Fleet, client: anthropic.Anthropic) -> None:
    # Given a chat with a system prompt, and its greedy text through the Python producer
    ask: dict[str, Any] = {"model": LM, "max_tokens": 24, "system": "Be brief.",
                           "messages": [{"role": "user", "content": [
                               {"type": "text", "text": "Tell me"},
                               {"type": "text", "text": "a story"}]}]}  # fmt: skip
    expected = produced(fleet, max_new_tokens=24, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me\na story"}])  # fmt: skip
    # When it is asked of the gateway with the anthropic client, whole
    rid = uuid.uuid4().hex
    raw = client.messages.with_raw_response.create(**ask, extra_headers={
        "X-Request-Id": rid})  # fmt: skip
    reply = raw.parse()
    # Then it is the same text, max_tokens reached, with Anthropic's fields
    assert text(reply) == expected.text and [b.type for b in reply.content] == ["text"]
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.id == f"msg_{rid}" == f"msg_{raw.headers['x-request-id']}"
    assert reply.usage.output_tokens == 24
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == (
        expected.prompt_tokens)  # fmt: skip
    # and sent again with the same id, it is the same single result
    again = client.messages.create(**ask, extra_headers={"X-Request-Id": rid})
    assert again.id == reply.id and again.content == reply.content
    # and streamed (the raw events): message_start first, one text block, message_stop last
    events = list(client.messages.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta"
                   and e.delta.type == "text_delta") == expected.text  # fmt: skip
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 24
    # and through the SDK's stream helper, its final message is the whole one
    with client.messages.stream(**ask) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == expected.text == text(final)
    assert [b.type for b in final.content] == ["text"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24
    assert final.usage.input_tokens == reply.usage.input_tokens


@pytest.mark.timeout(240)
def test_stop_sequences_and_sampling_fields(fleet: Fleet, client: anthropic.Anthropic) -> None:
    user = [{"role": "user", "content": "the cat"}]
    whole = produced(fleet, messages=user, max_new_tokens=24).text
    stop = next(whole[i : i + 3] for i in range(4, len(whole) - 3) if whole[i : i + 3].strip())
    # Given a stop sequence from the middle of the greedy text
    expected = produced(fleet, messages=user, max_new_tokens=24, stop=[stop]).text
    assert len(expected) < len(whole)
    for stream in (False, True):
        if stream:
            with client.messages.stream(model=LM, max_tokens=24, messages=user,  # type: ignore[arg-type]
                                              stop_sequences=[stop]) as s:  # fmt: skip
                reply = s.get_final_message()
        else:
            reply = client.messages.create(model=LM, max_tokens=24, messages=user,  # type: ignore[arg-type]
                                                 stop_sequences=[stop])  # fmt: skip
        # Then the text ends before it, and the message names it
        assert text(reply) == expected and reply.stop_reason == "stop_sequence"
        assert reply.stop_sequence == stop
    # top_k 1 is greedy whatever the temperature (this SDK sends neither but as extras)
    topk = client.messages.create(model=LM, max_tokens=24, messages=user,  # type: ignore[arg-type]
                                        extra_body={"temperature": 1.0, "top_k": 1})  # fmt: skip
    assert text(topk) == whole


@pytest.mark.timeout(240)
def test_a_tool_use_and_tool_result_round_trip(fleet: Fleet, client: anthropic.Anthropic) -> None:
    user = {"role": "user", "content": "weather?"}
    # Given a tool and tool_choice any (the grammar makes the random model call it)
    ask: dict[str, Any] = {"model": LM, "max_tokens": 200, "messages": [user],
                           "tools": [WEATHER], "tool_choice": {"type": "any",
                                                               "disable_parallel_tool_use": True}}  # fmt: skip
    reply = client.messages.create(**ask)
    # Then the call is a tool_use block, its input an object, and the stop reason says so
    assert reply.stop_reason == "tool_use"
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")  # type: ignore[index]
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    same = produced(fleet, max_new_tokens=200, messages=[user], tools=tools,
                    tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert same.tool_calls and json.loads(same.tool_calls[0].function.arguments) == call.input
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == (
        same.prompt_tokens)  # fmt: skip
    # and streamed, the SDK puts the same call together from its input_json_delta pieces
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content
            ] == [(b.type, getattr(b, "name", None), getattr(b, "input", None))
                  for b in reply.content]  # fmt: skip
    # When the call and its result go back as Anthropic writes them
    chat: list[Any] = [user, {"role": "assistant", "content": reply.content},
                       {"role": "user", "content": [{"type": "tool_result",
                                                     "tool_use_id": call.id, "content": "sunny"}]}]  # fmt: skip
    follow = client.messages.create(model=LM, max_tokens=8, messages=chat,
                                          thinking={"type": "disabled"})  # fmt: skip
    # Then the model reads the same prompt, and answers the same, as with the OpenAI-shaped
    # chat through the producer
    past = {"id": call.id, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps(call.input, separators=(",", ":"))}}  # fmt: skip
    expected = produced(fleet, max_new_tokens=8, messages=[
        user, {"role": "assistant", "content": None, "tool_calls": [past]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
        chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert expected.text and text(follow) == expected.text
    assert follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0) == (
        expected.prompt_tokens)  # fmt: skip


@pytest.mark.timeout(240)
def test_errors_are_the_sdks_exceptions(fleet: Fleet, client: anthropic.Anthropic) -> None:
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=LM, messages=user, max_tokens=anthropic.omit)  # type: ignore[arg-type]
    assert bad.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens is required"}}  # fmt: skip
    for stream in (False, True):
        with pytest.raises(anthropic.NotFoundError) as nf:
            client.messages.create(model="nope", messages=user, max_tokens=4, stream=stream)  # type: ignore[arg-type, call-overload]
        assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    # a value the producer refuses
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model=LM, messages=user, max_tokens=4,  # type: ignore[arg-type]
                          extra_body={"temperature": -1})  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=LM, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}])  # fmt: skip
    wrong = anthropic.Anthropic(base_url=fleet.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        wrong.messages.create(model=LM, messages=user, max_tokens=4)  # type: ignore[arg-type]
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=user)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_count_tokens_counts_the_chat_as_messages_renders_it(
    fleet: Fleet, client: anthropic.Anthropic
) -> None:
    ask: dict[str, Any] = {"model": LM, "system": "Be brief.", "tools": [WEATHER],
                           "messages": [{"role": "user", "content": "weather?"}]}  # fmt: skip
    # Given a chat with a system prompt and a tool, When its tokens are counted
    counted = client.messages.count_tokens(**ask)
    # Then they are the prompt the same chat is answered from
    reply = client.messages.create(**ask, max_tokens=1)
    assert counted.input_tokens == reply.usage.input_tokens + (
        reply.usage.cache_read_input_tokens or 0)  # fmt: skip
    assert (
        counted.input_tokens
        > client.messages.count_tokens(model=LM, messages=ask["messages"]).input_tokens
    )  # the template renders the tools


@pytest.mark.timeout(240)
def test_a_client_that_leaves_mid_stream_cancels_its_request(fleet: Fleet) -> None:
    body = {"model": LM, "max_tokens": 4000, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "the cat"}]}  # fmt: skip
    # Given a long streamed generation, read until its text flows, When the client closes
    # the connection
    out = leave_mid_stream(fleet, "/v1/messages", body,
                           lambda line: line == b"event: content_block_delta\n")  # fmt: skip
    # Then the fleet stops it: cancelled, short
    assert out["finish_reason"] == "cancelled" and out["completion_tokens"] < 4000
