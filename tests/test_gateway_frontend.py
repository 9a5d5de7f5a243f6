"""vLLM's frontend switches on the gateway (``--response-role``, ``--fingerprint-mode
custom`` (its other modes: ``test_gateway_fingerprint.py``), ``--enable-force-include-usage``, ``--exclude-tools-when-tool-choice-none``,
``--enable-per-request-metrics``, ``--enable-tokenizer-info-endpoint``): the rules as
functions, then the gateway in-process against a real Redis with the test playing the
worker, a real worker publishing its tokenizer, and the command line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.producer.gateway.answers import chat_response, completion_response
from batchfleet.producer.gateway.chunks import Chunks
from batchfleet.producer.gateway.endpoint import Answered
from batchfleet.producer.gateway.frontend import (
    Frontend,
    chat_role,
    stream_usage,
    timing_metrics,
    without_tools,
)
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Result, Timings, Usage
from batchfleet.schemas.model_info import ModelInfo
from batchfleet.worker.tokenizer_info import tokenizer_info
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml
from gateway_fakes import ScriptedWorker, gateway_cli, gateway_in_process, http

CHAT = {"model": "mm", "messages": [{"role": "user", "content": "hi"}]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
TIMINGS = Timings(queued_ms=5.0, batch_wait_ms=15.0, inference_ms=100.0, total_ms=121.0,
                  first_token_ms=40.0)  # fmt: skip
"""Scheduled 20 ms after enqueue, first token at 40, last at 120."""
ALL_ON = Frontend("bot", "fp-7", True, True, True, True, "custom")


def gen(text: str = "Hi!", tokens: int = 5) -> dict[str, Any]:
    return {"text": text, "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": tokens}


def result(*outputs: dict[str, Any], timings: Timings = TIMINGS) -> Result:
    return Result(id="r", model="mm", status="ok", outputs=list(outputs), timings=timings,
                  usage=Usage(prompt_tokens=3, completion_tokens=5))  # fmt: skip


# --- the rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "role"), [
    (CHAT, "bot"),
    (CHAT | {"add_generation_prompt": True}, "bot"),
    # no generation prompt: the model goes on with the last message, in its role (vLLM's)
    (CHAT | {"add_generation_prompt": False}, "user"),
    ({"messages": [*CHAT["messages"], {"role": "assistant", "content": "He"}],
      "add_generation_prompt": False, "continue_final_message": True}, "assistant"),
])  # fmt: skip
def test_the_chat_answer_s_role_is_vllm_s(body: dict[str, Any], role: str) -> None:
    assert chat_role(body, Frontend(response_role="bot")) == role


@pytest.mark.parametrize(("options", "force", "expect"), [
    (None, False, (False, False)),
    (None, True, (True, False)),
    ({"include_usage": False}, True, (True, False)),
    ({"include_usage": False, "continuous_usage_stats": True}, True, (True, True)),
    ({"include_usage": False, "continuous_usage_stats": True}, False, (False, False)),
    ({"include_usage": True}, False, (True, False)),
])  # fmt: skip
def test_force_include_usage_is_vllm_s_should_include_usage(
    options: Any, force: bool, expect: tuple[bool, bool]
) -> None:
    body = {} if options is None else {"stream_options": options}
    assert stream_usage(body, Frontend(force_include_usage=force)) == expect


def test_tools_are_left_out_only_where_tool_choice_is_none_and_the_switch_is_on() -> None:
    on = Frontend(exclude_tools_when_tool_choice_none=True)
    asked = {"messages": [], "tools": TOOLS, "tool_choice": "none"}
    assert without_tools(asked, on) == {"messages": [], "tool_choice": "none"}
    assert without_tools(asked, Frontend()) == asked
    for choice in ("auto", "required", None):
        assert without_tools(asked | {"tool_choice": choice}, on)["tools"] == TOOLS


def test_timing_metrics_are_vllm_s_from_the_fleet_s_timings() -> None:
    # scheduled at 20 ms, first token at 40, last at 20 + 100: vLLM's formulas
    assert timing_metrics(result(gen(tokens=5))) == {
        "time_to_first_token_ms": 20.0, "generation_time_ms": 80.0, "queue_time_ms": 20.0,
        "mean_itl_ms": 20.0, "tokens_per_second": 50.0,
    }  # fmt: skip
    one = timing_metrics(result(gen(tokens=1)))
    assert one is not None and one["mean_itl_ms"] is None and one["tokens_per_second"] == 10.0
    # nothing generated: only the queue is known
    none = timing_metrics(result(gen(tokens=0), timings=Timings(queued_ms=2.0, inference_ms=5.0)))
    assert none == {"time_to_first_token_ms": None, "generation_time_ms": None,
                    "queue_time_ms": 2.0, "mean_itl_ms": None, "tokens_per_second": None}  # fmt: skip
    # several outputs (n > 1, several prompts): none, as vLLM's
    assert timing_metrics(result(gen(), gen())) is None


def test_whole_answers_carry_the_role_fingerprint_and_metrics() -> None:
    answered = Answered("x-1", 1700000000, frontend=ALL_ON, system_fingerprint="fp-7")
    chat = chat_response(CHAT, result(gen()), answered)
    assert chat["choices"][0]["message"]["role"] == "bot"
    assert chat["system_fingerprint"] == "fp-7"
    assert chat["metrics"] == timing_metrics(result(gen()))
    text = completion_response({"prompt": "a"}, result(gen(), gen()), answered)
    assert text["system_fingerprint"] == "fp-7" and text["metrics"] is None  # two outputs
    # off: as before (no metrics key, a null fingerprint, assistant)
    plain = chat_response(CHAT, result(gen()), Answered("x-1", 1700000000))
    assert "metrics" not in plain and plain["system_fingerprint"] is None
    assert plain["choices"][0]["message"]["role"] == "assistant"


def test_a_stream_opens_with_the_role_and_ends_with_usage_and_metrics_when_forced() -> None:
    chunks = Chunks(CHAT, Answered("x-1", 1700000000, frontend=ALL_ON), "mm", chat=True)
    events = chunks.finish(result(gen()))
    assert events[0]["choices"][0]["delta"]["role"] == "bot"
    assert "system_fingerprint" not in events[0]  # vLLM's chunks leave it out
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert last["metrics"] == timing_metrics(result(gen()))
    # metrics' unknown fields are left out of a chunk (vLLM's exclude_none)
    bare = Chunks(CHAT, Answered("x-1", 1, frontend=ALL_ON), "mm", chat=True)
    ended = bare.finish(result(gen(tokens=0), timings=Timings(queued_ms=2.0)))
    assert ended[-1]["metrics"] == {"queue_time_ms": 2.0}
    # without the force, no usage chunk (and so no metrics)
    off = Chunks(CHAT, Answered("x-1", 1, frontend=Frontend(per_request_metrics=True)), "mm",
                 chat=True)  # fmt: skip
    assert all("usage" not in e and "metrics" not in e for e in off.finish(result(gen())))
    # usage asked, metrics off: the usage chunk alone
    asked = Chunks(CHAT | {"stream_options": {"include_usage": True}}, Answered("x-1", 1),
                   "mm", chat=True)  # fmt: skip
    last = asked.finish(result(gen()))[-1]
    assert last["usage"]["completion_tokens"] == 5 and "metrics" not in last


def test_tokenizer_info_is_vllm_s_body(tiny_lm: Path) -> None:
    from transformers import AutoTokenizer

    class Runner:
        tokenizer = AutoTokenizer.from_pretrained(tiny_lm)

    info = tokenizer_info(Runner())
    assert info is not None
    assert info["tokenizer_class"] == type(Runner.tokenizer).__name__
    assert info["chat_template"] == Runner.tokenizer.chat_template
    assert "vocab_file" not in info and "merges_file" not in info
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>"  # an AddedToken's text
    assert json.loads(json.dumps(info)) == info
    Runner.tokenizer.init_kwargs["odd"] = {"kept": 1, "object": object()}
    assert tokenizer_info(Runner())["odd"] == {"kept": 1}  # type: ignore[index]
    assert tokenizer_info(object()) is None  # no tokenizer


# --- the gateway -----------------------------------------------------------------------------


def test_the_switches_on_the_gateway(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "mm")

    async def ask(
        port: int, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> tuple[Any, Any]:
        """``body`` answered with one output and TIMINGS: what the worker read, and the
        answer (a stream's events)."""
        sent = asyncio.ensure_future(http(port, "POST", path, body))
        taken = await asyncio.to_thread(fake.take)
        if body.get("stream"):
            await asyncio.to_thread(fake.delta, taken, 1, "Hi!")
            await asyncio.to_thread(fake.delta, taken, 2)
        await asyncio.to_thread(fake.answer, taken, result(gen()) .model_copy(
            update={"id": taken.id}))  # fmt: skip
        status, raw = await sent
        assert status == 200, raw
        if body.get("stream"):
            events = raw.decode().split("data: ")[1:]
            return taken.request, [json.loads(e) for e in events[:-1]]
        return taken.request, json.loads(raw)

    async def go() -> None:
        async with gateway_in_process(redis_url, frontend=ALL_ON) as port:
            # tool_choice none: the worker's request has no tools; other choices keep them
            request, answer = await ask(port, CHAT | {"tools": TOOLS, "tool_choice": "none"})
            assert request.tools is None and request.tool_choice == "none"
            assert answer["choices"][0]["message"]["role"] == "bot"
            assert answer["system_fingerprint"] == "fp-7"
            assert answer["metrics"]["time_to_first_token_ms"] == 20.0
            request, _ = await ask(port, CHAT | {"tools": TOOLS, "tool_choice": "auto"})
            assert request.tools is not None and len(request.tools) == 1
            # the Responses and Messages APIs' chats too
            tool = {"type": "function", "name": "f", "parameters": {}}
            request, _ = await ask(port, {"model": "mm", "input": "hi", "tools": [tool],
                                          "tool_choice": "none"}, "/v1/responses")  # fmt: skip
            assert request.tools is None and request.tool_choice == "none"
            anthropic = {"model": "mm", "max_tokens": 5, "messages": CHAT["messages"],
                         "tools": [{"name": "f", "input_schema": {"type": "object"}}]}  # fmt: skip
            request, _ = await ask(port, anthropic | {"tool_choice": {"type": "none"}},
                                   "/v1/messages")  # fmt: skip
            assert request.tools is None and request.tool_choice == "none"
            # a stream that asks no usage ends with it, and the metrics
            _, events = await ask(port, CHAT | {"stream": True})
            assert events[0]["choices"][0]["delta"]["role"] == "bot"
            assert events[-1]["usage"]["total_tokens"] == 8
            assert events[-1]["metrics"]["queue_time_ms"] == 20.0
        async with gateway_in_process(redis_url) as port:  # vLLM's defaults (fingerprint: full)
            request, answer = await ask(port, CHAT | {"tools": TOOLS, "tool_choice": "none"})
            assert request.tools is not None
            assert answer["choices"][0]["message"]["role"] == "assistant"
            # its workers publish no serving hash: the fingerprint is not known
            assert answer["system_fingerprint"] is None and "metrics" not in answer
            _, events = await ask(port, CHAT | {"stream": True})
            assert all("usage" not in e for e in events)

    try:
        asyncio.run(go())
    finally:
        client.close()


def test_tokenizer_info_route(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    config = {"tokenizer_class": "T", "chat_template": "{{ x }}", "model_max_length": 8}
    ScriptedWorker(client, "mm").streams.publish_tokenizer(config)

    async def get(port: int, query: str = "", key: str | None = "sk-test") -> tuple[int, Any]:
        status, raw = await http(port, "GET", "/tokenizer_info" + query, key=key)
        return status, json.loads(raw)

    async def go() -> None:
        async with gateway_in_process(redis_url) as port:  # off by default, as vLLM's
            status, body = await get(port)
            assert status == 404 and body["error"]["code"] == "not_found"
        on = Frontend(tokenizer_info=True)
        async with gateway_in_process(redis_url, frontend=on) as port:
            # the fleet's one model, named or not
            assert await get(port) == (200, config)
            assert await get(port, "?model=mm") == (200, config)
            assert (await get(port, key=None))[0] == 401
            # a model with no worker: 404; one whose workers published no tokenizer: 404
            status, body = await get(port, "?model=nope")
            assert (status, body["error"]["code"]) == (404, "model_not_found")
            ScriptedWorker(client, "enc", info=ModelInfo(task="embedding"))
            status, body = await get(port, "?model=enc")
            assert status == 404 and "published no tokenizer" in body["error"]["message"]
        async with gateway_in_process(redis_url, frontend=on) as port:
            # two models: name one
            status, body = await get(port)
            assert (status, body["error"]["param"]) == (400, "model")

    try:
        asyncio.run(go())
    finally:
        client.close()


def test_a_worker_publishes_its_tokenizer_for_the_route(
    redis_url: str, r: redis.Redis, start_worker: Callable[..., WorkerProcess], tiny_lm: Path,
) -> None:  # fmt: skip
    from transformers import AutoTokenizer

    spec = {"runner": "text-generation", "path": str(tiny_lm), "options": TINY_LM_OPTIONS}
    start_worker(fleet_toml(redis_url, {"gen": spec}), "gen-1").wait_ready(r, "gen")
    assert r.get(ModelKeys("gen").tokenizer) is not None

    async def go() -> Any:
        async with gateway_in_process(redis_url, frontend=Frontend(tokenizer_info=True)) as port:
            status, raw = await http(port, "GET", "/tokenizer_info?model=gen")
            assert status == 200, raw
            return json.loads(raw)

    body = asyncio.run(go())
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm)
    assert body["chat_template"] == tokenizer.chat_template
    assert body["tokenizer_class"] == type(tokenizer).__name__
    assert body["eos_token"] == "<|im_end|>"


# --- the command line --------------------------------------------------------------------


def test_the_gateway_s_flags_and_their_environment_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway = gateway_cli(monkeypatch)
    url = ("--redis-url", "redis://127.0.0.1:1/0")
    assert gateway(*url)["frontend"] == Frontend()
    given = gateway(*url, "--response-role", "bot", "--fingerprint-mode", "custom",
                    "--fingerprint-value", "fp-7", "--enable-force-include-usage",
                    "--exclude-tools-when-tool-choice-none", "--enable-per-request-metrics",
                    "--enable-tokenizer-info-endpoint")  # fmt: skip
    assert given["frontend"] == ALL_ON
    monkeypatch.setenv("BATCHFLEET_RESPONSE_ROLE", "bot")
    monkeypatch.setenv("BATCHFLEET_ENABLE_FORCE_INCLUDE_USAGE", "true")
    monkeypatch.setenv("BATCHFLEET_FINGERPRINT_MODE", "custom")
    monkeypatch.setenv("BATCHFLEET_FINGERPRINT_VALUE", "fp-env")
    assert gateway(*url)["frontend"] == Frontend("bot", "fp-env", True, fingerprint_mode="custom")


@pytest.mark.parametrize(("flags", "said"), [
    (["--fingerprint-mode", "custom"], "needs --fingerprint-value"),
    (["--fingerprint-value", "x"], "without --fingerprint-mode custom"),
    (["--response-role", ""], "must not be empty"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be a whole number >= 1, not 0"),
])  # fmt: skip
def test_flags_the_gateway_refuses(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from batchfleet import cli

    gateway_cli(monkeypatch)  # (a regression serves nothing: it returns at once)
    assert cli.main(["gateway", "--redis-url", "redis://127.0.0.1:1/0", *flags]) == 2
    assert said in capsys.readouterr().err
