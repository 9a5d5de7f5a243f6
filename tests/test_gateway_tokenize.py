"""The prompt-only routes: vLLM's ``/tokenize`` and ``/detokenize``, Anthropic's
``/v1/messages/count_tokens``, and ``/v1/completions``' prompt scoring (``echo``,
``logprobs``, ``max_tokens`` 0): the translation without a server, then the gateway
in-process against a real Redis with the test playing the worker (the fleet request each
route submits, the answer it makes of the result, its errors), through the official
clients where they have the call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest
import redis
from batchfleet.producer.gateway.anthropic_fields import submission
from batchfleet.producer.gateway.endpoint import Answered
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.gateway.tokenization import (
    count_submission,
    detokenize_answer,
    detokenize_submission,
    tokenize_answer,
    tokenize_submission,
)
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.inputs import TokenPrompt
from batchfleet.schemas.messages import ErrorInfo, Result, Usage
from batchfleet.schemas.model_info import ModelInfo
from gateway_fakes import GATEWAY_KEY, ScriptedWorker, Taken, gateway_in_process, http
from test_gateway_units import built

ANSWERED = Answered("x-1", 1700000000)
MODEL = "tk"
CHAT = [{"role": "user", "content": "hi"}]

# --- the translation -----------------------------------------------------------------------


def test_tokenize_asks_the_prompt_only_with_its_token_ids() -> None:
    request = built(tokenize_submission({"model": MODEL, "prompt": "the cat",
                                         "add_special_tokens": True}))  # fmt: skip
    assert request.inputs == ["the cat"] and request.messages is None
    assert (request.max_new_tokens, request.return_token_ids) == (0, True)
    # the defaults (a text with special tokens, a chat without) and no strings go as
    # nothing, so workers from before those fields serve them
    assert (request.add_special_tokens, request.return_token_strs) == (None, None)
    strs = built(tokenize_submission({"model": MODEL, "prompt": "the cat",
                                      "add_special_tokens": False, "return_token_strs": True}))  # fmt: skip
    assert (strs.add_special_tokens, strs.return_token_strs) == (False, True)
    # a chat, rendered as the chat route renders it (tools and the template's switches)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = built(tokenize_submission({
        "model": MODEL, "messages": [{"role": "developer", "content": "be kind"}, *CHAT,
                                     {"role": "assistant", "content": "Hel"}],
        "tools": tools, "chat_template_kwargs": {"enable_thinking": False},
        "chat_template": "{{ messages | length }}",
        "add_generation_prompt": False, "continue_final_message": True,
        "add_special_tokens": False}))  # fmt: skip
    assert chat.add_special_tokens is None
    again = built(tokenize_submission({"model": MODEL, "messages": CHAT,
                                       "add_special_tokens": True}))  # fmt: skip
    assert again.add_special_tokens is True
    assert [m.role for m in chat.messages] == ["system", "user", "assistant"] and chat.tools
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.chat_template == "{{ messages | length }}"  # rendered as the chat route's
    assert (chat.add_generation_prompt, chat.continue_final_message) == (False, True)
    assert (chat.max_new_tokens, chat.return_token_ids) == (0, True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a"}, "model"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": [1, 2]}, "prompt"),
        ({"model": MODEL, "prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
        ({"model": MODEL, "prompt": "a", "add_special_tokens": 0}, "add_special_tokens"),
        ({"model": MODEL, "messages": CHAT, "add_special_tokens": "no"}, "add_special_tokens"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "tokens": []}, "tokens"),
        ({"model": MODEL, "tokens": [1, -1]}, "tokens"),
        ({"model": MODEL, "tokens": [1, "a"]}, "tokens"),
        ({"model": MODEL, "tokens": [True]}, "tokens"),
        ({"model": MODEL}, "tokens"),
    ],
)  # fmt: skip
def test_bodies_refused_before_the_fleet(body: dict[str, Any], param: str) -> None:
    make = detokenize_submission if param == "tokens" else tokenize_submission
    with pytest.raises(ApiError) as e:
        make(body)
    assert (e.value.status, e.value.param) == (400, param)


def test_detokenize_asks_the_prompts_text() -> None:
    sub = detokenize_submission({"model": MODEL, "tokens": [1, 5, 7]})
    assert sub.options == {"inputs": [TokenPrompt(prompt_token_ids=[1, 5, 7])],
                           "max_new_tokens": 0, "return_prompt_text": True}  # fmt: skip


def test_count_tokens_renders_the_chat_as_messages_does() -> None:
    body = {"model": MODEL, "system": "Be brief.", "messages": CHAT, "stream": True,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "thinking": {"type": "disabled"}}  # fmt: skip
    counted = built(count_submission(body))
    asked = built(submission(body | {"max_tokens": 9}))
    assert counted.messages == asked.messages and counted.tools == asked.tools
    assert counted.chat_template_kwargs == asked.chat_template_kwargs == {"enable_thinking": False}
    assert (counted.max_new_tokens, counted.stream) == (0, None)


def result(output: dict[str, Any]) -> Result:
    return Result.model_validate({"id": "r1", "model": MODEL, "status": "ok",
                                  "outputs": [output]})  # fmt: skip


def test_answers_and_a_worker_that_left_the_field_out() -> None:
    out = {"text": "", "finish_reason": "length", "prompt_tokens": 3}
    ids = result(out | {"prompt_token_ids": [1, 5, 7]})
    assert tokenize_answer({}, ids, ANSWERED) == {"count": 3, "tokens": [1, 5, 7],
                                                  "token_strs": None}  # fmt: skip
    known = Answered("x-1", 1700000000, max_model_len=2048)
    assert tokenize_answer({}, ids, known) == {"count": 3, "max_model_len": 2048,
                                               "tokens": [1, 5, 7], "token_strs": None}  # fmt: skip
    text = result(out | {"prompt_text": "<s>the cat"})
    assert detokenize_answer({}, text, ANSWERED) == {"prompt": "<s>the cat"}
    strs = result(
        out | {"prompt_token_ids": [1, 5, 7], "prompt_token_strs": ["<s>", "the", "Ġcat"]}
    )
    assert tokenize_answer({"return_token_strs": True}, strs, ANSWERED)["token_strs"] == [
        "<s>", "the", "Ġcat"]  # fmt: skip
    assert tokenize_answer({}, strs, ANSWERED)["token_strs"] is None
    for answer, asked in ((tokenize_answer, {}), (detokenize_answer, {}),
                          (tokenize_answer, {"return_token_strs": True})):  # fmt: skip
        with pytest.raises(ApiError) as e:
            answer(asked, result(out | ({"prompt_token_ids": [1]} if asked else {})), ANSWERED)
        assert e.value.status == 500 and "older" in e.value.message


# --- the gateway, the test playing the worker ----------------------------------------------


def playing(redis_url: str, go: Callable[[int, ScriptedWorker], Awaitable[None]]) -> None:
    """``go(port, worker)`` with the gateway in-process and ``MODEL``'s scripted worker."""
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, MODEL)

    async def run() -> None:
        async with gateway_in_process(redis_url) as port:
            await go(port, fake)

    try:
        asyncio.run(run())
    finally:
        client.close()


async def asked(
    port: int, fake: ScriptedWorker, path: str, body: Any, output: dict[str, Any] | Result
) -> tuple[Taken, int, Any]:
    """``body`` POSTed to ``path``, the request the worker took answered with ``output``
    (one output, or a whole result): the request, the status and the JSON answer."""
    ask = asyncio.ensure_future(http(port, "POST", path, body))
    taken = await asyncio.to_thread(fake.take)
    if isinstance(output, Result):
        await asyncio.to_thread(fake.answer, taken, output.model_copy(update={"id": taken.id}))
    else:
        usage = Usage(prompt_tokens=output.get("prompt_tokens", 0))
        await asyncio.to_thread(fake.ok, taken, [output], usage)
    status, raw = await ask
    return taken, status, json.loads(raw)


PROMPT_ONLY = {"text": "", "finish_reason": "length", "prompt_tokens": 3}


def failed(code: ErrorCode, message: str) -> Result:
    return Result(id="r", model=MODEL, status="error", error=ErrorInfo(code=code,
                                                                       message=message))  # fmt: skip


def test_tokenize_and_detokenize_routes(redis_url: str) -> None:
    async def go(port: int, fake: ScriptedWorker) -> None:
        # Given a prompt to tokenize, When the worker answers its prompt-only request
        taken, status, body = await asked(port, fake, "/tokenize", {
            "model": MODEL, "prompt": "the cat"}, PROMPT_ONLY | {"prompt_token_ids": [1, 5, 7]})  # fmt: skip
        # Then the fleet request generated nothing and asked the ids; the answer is vLLM's
        request = taken.request
        assert request.inputs == ["the cat"] and request.max_new_tokens == 0
        assert request.return_token_ids is True
        assert (status, body) == (200, {"count": 3, "tokens": [1, 5, 7], "token_strs": None})
        # and a chat's tokens are its rendered template's
        taken, status, body = await asked(port, fake, "/tokenize", {
            "model": MODEL, "messages": CHAT}, PROMPT_ONLY | {"prompt_token_ids": [1, 2, 3]})  # fmt: skip
        assert taken.request.messages is not None and taken.request.messages[0].content == "hi"
        assert status == 200 and body["count"] == 3
        # the tokenizer's strings and its special tokens left off, as asked
        taken, status, body = await asked(port, fake, "/tokenize", {
            "model": MODEL, "prompt": "the cat", "return_token_strs": True,
            "add_special_tokens": False}, PROMPT_ONLY | {"prompt_token_ids": [5, 7],
                                                         "prompt_token_strs": ["the", "Ġcat"]})  # fmt: skip
        assert (taken.request.return_token_strs, taken.request.add_special_tokens) == (True, False)
        assert (status, body) == (200, {"count": 2, "tokens": [5, 7],
                                        "token_strs": ["the", "Ġcat"]})  # fmt: skip
        # a worker from before return_token_strs refuses the field it does not know: a 400
        _, status, body = await asked(port, fake, "/tokenize", {
            "model": MODEL, "prompt": "a", "return_token_strs": True}, failed(
                ErrorCode.INVALID_REQUEST, "return_token_strs: Extra inputs are not permitted"))  # fmt: skip
        assert status == 400 and body["error"]["code"] == "invalid_request"
        # and ids back to their text
        taken, status, body = await asked(port, fake, "/detokenize", {
            "model": MODEL, "tokens": [1, 5, 7]}, PROMPT_ONLY | {"prompt_text": "<s>the cat"})  # fmt: skip
        (tokens,) = taken.request.inputs
        assert isinstance(tokens, TokenPrompt) and tokens.prompt_token_ids == [1, 5, 7]
        assert taken.request.max_new_tokens == 0
        assert (status, body) == (200, {"prompt": "<s>the cat"})
        # a token the model does not have: the worker's refusal, a 400
        _, status, body = await asked(port, fake, "/detokenize", {
            "model": MODEL, "tokens": [99999]}, failed(ErrorCode.INVALID_INPUT,
                                                       "99999 is not a token of this model"))  # fmt: skip
        assert status == 400 and body["error"]["code"] == "invalid_input"
        assert "99999" in body["error"]["message"]
        # refused before the fleet: OpenAI's errors, with the param
        status, raw = await http(port, "POST", "/detokenize", {"model": MODEL, "tokens": []})
        assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"
        status, raw = await http(port, "POST", "/tokenize", {"model": "nope", "prompt": "a"})
        assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
        assert (await http(port, "POST", "/tokenize", {"model": MODEL, "prompt": "a"},
                           key="wrong"))[0] == 401  # fmt: skip
        status, raw = await http(port, "GET", "/metrics", key=None)
        assert 'route="/tokenize"' in raw.decode() and 'route="/detokenize"' in raw.decode()

    playing(redis_url, go)


def test_max_model_len_where_the_workers_published_it(redis_url: str) -> None:
    """vLLM's ``max_model_len`` in ``/tokenize`` and the model cards, from the model's
    published info; left out for a model whose workers published none (older ones)."""
    client = redis.Redis.from_url(redis_url)
    # Given a model whose worker published its info, and one whose worker did not
    info = ModelInfo(task="text-generation", max_model_len=2048, created=1700000000)
    fake = ScriptedWorker(client, MODEL, info=info)
    ScriptedWorker(client, "older")

    async def go(port: int) -> None:
        # When a prompt is tokenized, Then the answer has the model's context length
        _, status, body = await asked(port, fake, "/tokenize", {"model": MODEL, "prompt": "a"},
                                      PROMPT_ONLY | {"prompt_token_ids": [1, 5, 7]})  # fmt: skip
        assert (status, body) == (200, {"count": 3, "max_model_len": 2048, "tokens": [1, 5, 7],
                                        "token_strs": None})  # fmt: skip
        # and the cards have it (and when the info was first published), the older not
        status, raw = await http(port, "GET", "/v1/models")
        cards = {c["id"]: c for c in json.loads(raw)["data"]}
        assert status == 200 and cards[MODEL]["max_model_len"] == 2048
        assert cards[MODEL]["created"] == 1700000000 and "max_model_len" not in cards["older"]
        status, raw = await http(port, "GET", f"/v1/models/{MODEL}")
        assert (status, json.loads(raw)) == (200, cards[MODEL])
        status, raw = await http(port, "GET", "/v1/models/older")
        assert status == 200 and json.loads(raw) == cards["older"]
        assert json.loads(raw)["created"] == 0
        status, raw = await http(port, "GET", "/v1/models/nope")
        assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
        # through the OpenAI client: an extra field of its Model
        oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=GATEWAY_KEY)
        card = await oai.models.retrieve(MODEL)
        assert (card.model_extra or {})["max_model_len"] == 2048
        await oai.close()

    async def run() -> None:
        async with gateway_in_process(redis_url) as port:
            await go(port)

    try:
        asyncio.run(run())
    finally:
        client.close()


def test_count_tokens_through_the_anthropic_client(redis_url: str) -> None:
    async def go(port: int, fake: ScriptedWorker) -> None:
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=GATEWAY_KEY,
                                     max_retries=0, timeout=30)  # fmt: skip
        # Given a chat with a system prompt, counted with the SDK's own call
        ask = asyncio.ensure_future(asyncio.to_thread(
            client.messages.count_tokens, model=MODEL, system="Be brief.", messages=CHAT))  # type: ignore[arg-type]  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, [PROMPT_ONLY | {"prompt_tokens": 12}],
                                Usage(prompt_tokens=12))  # fmt: skip
        # Then the fleet renders it as /v1/messages does, generating nothing
        assert [(m.role, m.content) for m in taken.request.messages or ()] == [
            ("system", "Be brief."), ("user", "hi")]  # fmt: skip
        assert taken.request.max_new_tokens == 0
        assert (await ask).input_tokens == 12
        # errors are Anthropic's: a worker's refusal, an unknown model
        chat = {"model": MODEL, "messages": CHAT}
        _, status, body = await asked(port, fake, "/v1/messages/count_tokens", chat,
                                      failed(ErrorCode.TOO_LARGE, "4100 prompt tokens"))  # fmt: skip
        assert (status, body) == (400, {"type": "error", "error": {
            "type": "invalid_request_error", "message": "4100 prompt tokens"}})  # fmt: skip
        with pytest.raises(anthropic.NotFoundError) as nf:
            await asyncio.to_thread(client.messages.count_tokens, model="nope", messages=CHAT)  # type: ignore[arg-type]
        assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        status, raw = await http(port, "POST", "/v1/messages/count_tokens",
                                 chat | {"messages": [{"role": "user", "content": [
                                     {"type": "image"}]}]})  # fmt: skip
        assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"

    playing(redis_url, go)


def test_prompt_scoring_through_the_openai_client(redis_url: str) -> None:
    def lp(token: int, text: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "text": text, "logprob": logprob,
                "top": [{"token": token, "text": text, "logprob": logprob}]}  # fmt: skip

    async def go(port: int, fake: ScriptedWorker) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=GATEWAY_KEY,
                               max_retries=0, timeout=30)  # fmt: skip
        # Given lm-evaluation-harness's loglikelihood call: echo, logprobs 1, max_tokens 0
        ask = asyncio.ensure_future(asyncio.to_thread(
            client.completions.create, model=MODEL, prompt="the cat", echo=True, logprobs=1,
            max_tokens=0))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        scored = PROMPT_ONLY | {"prompt_tokens": 2, "prompt_logprobs": [None, lp(7, " cat", -2.0)]}
        await asyncio.to_thread(fake.ok, taken, [scored], Usage(prompt_tokens=2))
        # Then the fleet scored the prompt and generated nothing
        request = taken.request
        assert (request.max_new_tokens, request.prompt_logprobs, request.logprobs) == (0, 1, 1)
        reply = await ask
        (choice,) = reply.choices
        assert choice.text == "the cat" and choice.finish_reason == "length"
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == ["the", " cat"]
        assert choice.logprobs.token_logprobs == [None, -2.0]
        assert choice.logprobs.top_logprobs == [None, {" cat": -2.0}]  # type: ignore[comparison-overlap]
        assert choice.logprobs.text_offset == [0, 3]
        assert reply.usage is not None and reply.usage.prompt_tokens == 2
        assert reply.usage.completion_tokens == 0
        # and a stop string that ended a text is its stop_reason
        ask = asyncio.ensure_future(asyncio.to_thread(
            client.completions.create, model=MODEL, prompt="the cat", stop=["."]))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, [{"text": " sat", "finish_reason": "stop",
                                                  "stop_reason": "."}])  # fmt: skip
        (choice,) = (await ask).choices
        assert choice.model_extra is not None and choice.model_extra["stop_reason"] == "."
        # max_tokens 0 without echo is refused, as vLLM refuses it
        with pytest.raises(openai.BadRequestError) as bad:
            await asyncio.to_thread(client.completions.create, model=MODEL, prompt="a",
                                    max_tokens=0)  # fmt: skip
        assert bad.value.param == "max_tokens"  # type: ignore[attr-defined]

    playing(redis_url, go)
