"""LoRA adapters through the gateway, as vLLM serves them: each adapter a model of its own
in ``/v1/models`` (its base model its ``parent``), named in a request's ``model``. The
gateway in-process against a real Redis with the test playing the worker: the fleet
request it submits (the base model, with ``lora``) and the answers, named after the
adapter."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import redis
from batchfleet.schemas.messages import Usage
from batchfleet.schemas.model_info import ModelInfo
from gateway_fakes import GATEWAY_KEY, ScriptedWorker, gateway_in_process, http

BASE = "lm"
CHAT = [{"role": "user", "content": "hi"}]
SAID = [{"text": "Hi!", "finish_reason": "stop"}]
USAGE = Usage(prompt_tokens=5, completion_tokens=2)


def events(body: bytes) -> list[dict[str, Any]]:
    """A stream's ``data:`` events (``[DONE]`` left out)."""
    return [json.loads(line[6:]) for line in body.decode().splitlines()
            if line.startswith("data: {")]  # fmt: skip


def test_adapters_are_models_and_requests_name_them(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    # Given a model whose workers serve two adapters, and a model with none
    info = ModelInfo(task="text-generation", max_model_len=2048, created=1700000000,
                     lora_adapters=["sql", "chat"])  # fmt: skip
    fake = ScriptedWorker(client, BASE, info=info)
    other = ScriptedWorker(client, "enc", info=ModelInfo(task="embedding", max_model_len=64))

    async def go(port: int) -> None:
        # When the models are listed, Then each adapter is a model, its base its parent
        status, raw = await http(port, "GET", "/v1/models")
        cards = {c["id"]: c for c in json.loads(raw)["data"]}
        assert status == 200 and sorted(cards) == ["chat", "enc", "lm", "sql"]
        assert cards["sql"]["parent"] == cards["chat"]["parent"] == BASE
        assert cards[BASE]["parent"] is None and cards["enc"]["parent"] is None
        assert cards["sql"]["max_model_len"] == 2048
        status, raw = await http(port, "GET", "/v1/models/sql")
        assert (status, json.loads(raw)) == (200, cards["sql"])
        # When a chat names an adapter, Then the base model's workers take it with lora,
        # and the answer names the adapter (vLLM's)
        ask = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions",
                                         {"model": "sql", "messages": CHAT}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        assert taken.request.model == BASE and taken.request.lora == "sql"
        await asyncio.to_thread(fake.ok, taken, SAID, USAGE)
        status, raw = await ask
        answer = json.loads(raw)
        assert status == 200 and answer["model"] == "sql"
        assert answer["choices"][0]["message"]["content"] == "Hi!"
        # streamed: every chunk names it
        ask = asyncio.ensure_future(http(port, "POST", "/v1/completions",
                                         {"model": "chat", "prompt": "a", "stream": True}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        assert taken.request.lora == "chat"
        await asyncio.to_thread(fake.delta, taken, 1, "Hi!")
        await asyncio.to_thread(fake.delta, taken, 2)
        await asyncio.to_thread(fake.ok, taken, SAID, USAGE)
        status, raw = await ask
        chunks = events(raw)
        assert status == 200 and chunks and {c["model"] for c in chunks} == {"chat"}
        # the Responses API's stream: its last event's response too
        ask = asyncio.ensure_future(http(port, "POST", "/v1/responses",
                                         {"model": "sql", "input": "a", "stream": True}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.delta, taken, 1, "Hi!")
        await asyncio.to_thread(fake.delta, taken, 2)
        await asyncio.to_thread(fake.ok, taken, SAID, USAGE)
        status, raw = await ask
        (done,) = [e for e in events(raw) if e["type"] == "response.completed"]
        assert status == 200 and done["response"]["model"] == "sql"
        # the base model's own requests carry no lora
        ask = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions",
                                         {"model": BASE, "messages": CHAT}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        assert taken.request.model == BASE and taken.request.lora is None
        await asyncio.to_thread(fake.ok, taken, SAID, USAGE)
        assert json.loads((await ask)[1])["model"] == BASE
        # through Anthropic's API too
        anth = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key=GATEWAY_KEY)
        ask = asyncio.ensure_future(anth.messages.create(model="sql", max_tokens=8, messages=CHAT))  # type: ignore[arg-type]
        taken = await asyncio.to_thread(fake.take)
        assert taken.request.lora == "sql"
        await asyncio.to_thread(fake.ok, taken, SAID, USAGE)
        assert (await ask).model == "sql"
        await anth.close()
        # a name that is neither a model nor an adapter is not found
        status, raw = await http(port, "POST", "/v1/chat/completions",
                                 {"model": "nope", "messages": CHAT})  # fmt: skip
        assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
        assert (await http(port, "GET", "/v1/models/nope"))[0] == 404

    async def run() -> None:
        async with gateway_in_process(redis_url) as port:
            await go(port)

    try:
        asyncio.run(run())
    finally:
        del other
        client.close()
