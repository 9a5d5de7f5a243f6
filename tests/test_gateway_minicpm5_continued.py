"""A ``minicpm5`` model's response continued, by ``previous_response_id`` or in a
conversation: the next turn's chat is the one vLLM builds from the stored output items
(``construct_input_messages``, ``construct_chat_messages_with_tool_call``), rendered by the
model's chat template as the worker renders it.

Its text thinks, says a line and calls a tool. Without a reasoning parser the thinking is
in no output item (the result's content is what follows the last ``</think>``, as vLLM's),
so no later turn holds it; with one (``qwen3``) it is a ``reasoning`` item, which
``previous_response_id`` leaves out of the next turn as vLLM's does ("We skip the reasoning
output") while a conversation's items, sent as vLLM takes input items, give it to the
assistant turn it belongs to (``reasoning_content``). The call stays in the next turn
either way: vLLM's ``previous_response_id`` drops it, a bug (vllm-project/vllm#43244), as
the ``function_call_output`` sent next answers a call the prompt would lack.

The runner (a tiny model, ``minicpm5`` tool parser, a chat template that writes calls,
reasoning and call ids) is given each answer's text; the gateway in process submits the
requests to a real Redis, where a scripted worker takes them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis
from devices import DEVICE

pytest.importorskip("torch")

from batchfleet.schemas.messages import Request, Result, Usage
from batchfleet.worker.runner import Final, Partial
from batchfleet.worker.runners.generation import TextGenerationRunner
from conftest import TINY_LM_OPTIONS
from gateway_fakes import ScriptedWorker, Taken, gateway_in_process, http
from test_gateway_minicpm5_streams import Made
from test_generation_tools import TOOLS, TOOLS_TEMPLATE

pytestmark = pytest.mark.timeout(120)
MODEL = "mm"
THOUGHT, SAID = "The user wants the weather.", "Let me look."
CALLING = (f"<think>\n{THOUGHT}\n</think>\n\n{SAID}\n<function name=\"get_weather\">\n"
           '<param name="unit">c</param>\n<param name="days">2</param>\n</function>')  # fmt: skip
"""The first answer's text: thinking, a line, a call."""
THOUGHT2, SUNNY = "It is sunny there.", "It is sunny."
ANSWERING = f"<think>\n{THOUGHT2}\n</think>\n\n{SUNNY}"
"""The second answer's text, once the call's output is in."""
QUESTION, THANKS = "the weather?", "thanks"
RESPONSE = {"model": MODEL, "tools": [{"type": "function", "name": "get_weather",
                                       "parameters": TOOLS[0]["function"]["parameters"]}]}  # fmt: skip


@pytest.fixture(scope="module", params=[None, "qwen3"], ids=["no-reasoning-parser", "qwen3"])
def runner(request: pytest.FixtureRequest, tiny_lm: Path) -> TextGenerationRunner:
    options = {**TINY_LM_OPTIONS, "tool_call_parser": "minicpm5", "chat_template": TOOLS_TEMPLATE}
    if request.param is not None:
        options["reasoning_parser"] = request.param
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32", options=options)


@pytest.fixture
def fake(r: redis.Redis) -> ScriptedWorker:
    return ScriptedWorker(r, MODEL)


def reasons(runner: TextGenerationRunner) -> bool:
    return runner.info()["reasoning_parser"] is not None


def made(runner: TextGenerationRunner, request: Request, text: str) -> Made:
    """``request`` admitted as a step admits it and given ``text`` a token a step: its
    deltas (streamed) and its result's outputs."""
    (prep,) = runner.prepare_many([request])
    runner._admit(request.id, prep, 1)
    r = runner._reqs[request.id]
    chunks: list[dict[str, Any]] = []
    for token in runner.tokenizer(text)["input_ids"]:
        r.seqs[0].text.extend([token])
        chunks += [ev.chunk for ev in runner._deltas(r) if isinstance(ev, Partial)]
    *tail, final = runner._finish(r)
    assert isinstance(final, Final)
    chunks += [ev.chunk for ev in tail if isinstance(ev, Partial)]
    return Made(chunks if request.stream else [], final.outputs)


def rendered(runner: TextGenerationRunner, request: Request) -> str:
    """The prompt the worker renders for ``request``."""
    (prep,) = runner.prepare_many([request.model_copy(update={"return_prompt_text": True})])
    (text,) = prep.payload.prompt_texts
    assert isinstance(text, str)
    return text


def vllm_prompt(runner: TextGenerationRunner, messages: list[dict[str, Any]]) -> str:
    """The prompt of the chat vLLM builds (``messages``), rendered the same way."""
    return rendered(runner, Request(id="vllm", model=MODEL, messages=messages, tools=TOOLS[:1]))


async def answered(port: int, fake: ScriptedWorker, runner: TextGenerationRunner,
                   body: dict[str, Any], text: str) -> tuple[dict[str, Any], Taken]:  # fmt: skip
    """``body`` sent to ``/v1/responses`` and answered with ``text``: the response (a
    stream's ``response.completed`` one) and the request the worker took."""
    sent = asyncio.ensure_future(http(port, "POST", "/v1/responses", RESPONSE | body))
    taken = await asyncio.to_thread(fake.take)
    got = made(runner, taken.request, text)
    if got.chunks:
        fake.streams.append_tokens(got.writes(taken.id, taken.reply))
    usage = Usage(prompt_tokens=got.outputs[0]["prompt_tokens"],
                  completion_tokens=got.outputs[0]["completion_tokens"])  # fmt: skip
    fake.answer(taken, Result(id=taken.id, model=MODEL, status="ok", outputs=got.outputs,
                              usage=usage))  # fmt: skip
    status, raw = await sent
    assert status == 200, raw
    if body.get("stream"):
        lines = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
        last = json.loads(lines[-1][6:])
        assert last["type"] == "response.completed"
        return last["response"], taken
    return json.loads(raw), taken


def first_turn(runner: TextGenerationRunner, response: dict[str, Any]) -> dict[str, Any]:
    """The first response's output as vLLM makes it of the result (its reasoning only with
    a reasoning parser; the thinking in no item without); the assistant turn vLLM builds of
    its items, with its ``reasoning``; the call's id."""
    kinds = [item["type"] for item in response["output"]]
    assert kinds == [*(["reasoning"] if reasons(runner) else []), "message", "function_call"]
    assert THOUGHT not in json.dumps(response["output"][-2:])
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == (
        "get_weather",
        {"unit": "c", "days": 2},
    )
    turn = {"role": "assistant", "content": SAID, "tool_calls": [
        {"id": call["call_id"], "type": "function",
         "function": {"name": "get_weather", "arguments": call["arguments"]}}]}  # fmt: skip
    if reasons(runner):
        assert response["output"][0]["content"][0]["text"] == THOUGHT
        turn["reasoning"] = THOUGHT
    return turn


def output_of(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call["tool_calls"][0]["id"],
            "output": "sunny"}  # fmt: skip


def test_previous_response_id_continues_without_the_reasoning_as_vllm_s(
    redis_url: str, fake: ScriptedWorker, runner: TextGenerationRunner
) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            first, _ = await answered(port, fake, runner, {"input": QUESTION}, CALLING)
            turn = first_turn(runner, first)
            # the call's output sent on: the question, the assistant's line and call (not
            # its reasoning: vLLM skips a previous output's), the output
            body = {"previous_response_id": first["id"], "input": [output_of(turn)]}
            second, taken = await answered(port, fake, runner, body, ANSWERING)
            said = {k: v for k, v in turn.items() if k != "reasoning"}
            chat = [{"role": "user", "content": QUESTION}, said,
                    {"role": "tool", "tool_call_id": said["tool_calls"][0]["id"],
                     "content": "sunny"}]  # fmt: skip
            prompt = rendered(runner, taken.request)
            assert prompt == vllm_prompt(runner, chat)
            assert THOUGHT not in prompt and "call get_weather c" in prompt
            # chained once more (streamed): no reasoning of either output
            body = {"previous_response_id": second["id"], "input": THANKS, "stream": True}
            _, taken = await answered(port, fake, runner, body, SUNNY)
            chat += [{"role": "assistant", "content": SUNNY}, {"role": "user", "content": THANKS}]
            prompt = rendered(runner, taken.request)
            assert prompt == vllm_prompt(runner, chat)
            assert THOUGHT not in prompt and THOUGHT2 not in prompt

    asyncio.run(go())


def test_a_conversation_continues_with_each_turn_s_reasoning_as_vllm_takes_its_items(
    redis_url: str, fake: ScriptedWorker, runner: TextGenerationRunner
) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            status, raw = await http(port, "POST", "/v1/conversations", {})
            assert status == 200, raw
            conversation = json.loads(raw)["id"]
            body = {"conversation": conversation, "input": QUESTION, "stream": True}
            first, _ = await answered(port, fake, runner, body, CALLING)
            turn = first_turn(runner, first)
            # the call's output sent on: the conversation's items as vLLM takes input
            # items, the reasoning (with a parser) on the assistant turn it belongs to
            body = {"conversation": conversation, "input": [output_of(turn)]}
            _, taken = await answered(port, fake, runner, body, ANSWERING)
            chat = [{"role": "user", "content": QUESTION}, turn,
                    {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"],
                     "content": "sunny"}]  # fmt: skip
            prompt = rendered(runner, taken.request)
            assert prompt == vllm_prompt(runner, chat)
            assert (f"thought {THOUGHT}" in prompt) is reasons(runner)
            # once more: the second answer's turn too
            body = {"conversation": conversation, "input": THANKS}
            _, taken = await answered(port, fake, runner, body, SUNNY)
            second = {"role": "assistant", "content": SUNNY}
            if reasons(runner):
                second["reasoning"] = THOUGHT2
            chat += [second, {"role": "user", "content": THANKS}]
            assert rendered(runner, taken.request) == vllm_prompt(runner, chat)
            status, raw = await http(
                port, "GET", f"/v1/conversations/{conversation}/items?order=asc"
            )
            kinds = [item["type"] for item in json.loads(raw)["data"]]
            assert kinds.count("reasoning") == (2 if reasons(runner) else 0)

    asyncio.run(go())
