"""A chat message's text parts through the gateway: kept as parts for workers that publish
``ModelInfo.content_parts`` (their ``chat_template_content_format`` decides), joined by
newlines for workers before it, which take text only. The gateway in-process against a
real Redis, the test playing each model's worker."""

from __future__ import annotations

import asyncio

import redis
from batchfleet.schemas.messages import TextPart, Usage
from batchfleet.schemas.model_info import ModelInfo
from gateway_fakes import ScriptedWorker, gateway_in_process, http

PARTS = [{"role": "user", "content": [{"type": "text", "text": "one"},
                                      {"type": "text", "text": "two"}]}]  # fmt: skip
SAID = [{"text": "ok", "finish_reason": "stop"}]


def test_text_parts_reach_workers_that_take_them_and_are_joined_for_older_ones(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    # Given a model whose workers take parts, one whose workers publish no such field
    # (before it), and one whose workers publish no info at all, behind one gateway
    new = ScriptedWorker(client, "new", info=ModelInfo(task="text-generation",
                                                      content_parts=True))  # fmt: skip
    old = ScriptedWorker(client, "old", info=ModelInfo(task="text-generation"))
    bare = ScriptedWorker(client, "bare")

    async def ask(port: int, fake: ScriptedWorker) -> object:
        call = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions",
                                          {"model": fake.model, "messages": PARTS}))  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, SAID, Usage(prompt_tokens=2, completion_tokens=1))
        assert (await call)[0] == 200
        (message,) = taken.request.messages or []
        return message.content

    async def run() -> None:
        async with gateway_in_process(redis_url) as port:
            # When each is asked with two text parts, Then the first gets the parts
            assert await ask(port, new) == [
                TextPart(type="text", text="one"),
                TextPart(type="text", text="two"),
            ]
            # and the others one text, the parts joined by a newline (as vLLM's string format)
            assert await ask(port, old) == "one\ntwo"
            assert await ask(port, bare) == "one\ntwo"

    try:
        asyncio.run(run())
    finally:
        client.close()
