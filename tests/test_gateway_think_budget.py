"""A ``thinking_token_budget`` to a model whose workers publish that they refuse one (no
reasoning markers, ``ModelInfo.thinking_token_budget`` false) is a 400 from the gateway
itself, on every generation route, with nothing submitted to the fleet; a model whose
workers take one, or say nothing (older workers), is asked as before."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.model_info import ModelInfo, decode_model_info
from test_gateway_replies import Worker
from test_gateway_responses import live

LANES = 3
CHAT = [{"role": "user", "content": "x"}]
ROUTES = [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/responses", {"input": "x"}),
    ("/v1/responses", {"input": "x", "background": True}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 8}),
]


def published(r: redis.Redis, takes: bool | None, **info: Any) -> ModelKeys:
    """Model ``m``'s workers started and published whether they take a budget (and
    ``info``'s other fields)."""
    keys = ModelKeys("m")
    r.set(keys.lanes_key, LANES)
    published = ModelInfo(task="text-generation", thinking_token_budget=takes, **info)
    r.set(keys.info, published.model_dump_json())
    return keys


async def answers(redis_url: str, r: redis.Redis, routes: list[tuple[str, dict[str, Any]]],
                  ask: dict[str, Any] | None = None) -> list[tuple[int, str]]:  # fmt: skip
    """Each route's status and body for ``ask`` (default: a budget of 4) to model ``m``: as
    the gateway answers it, or, once submitted, as its worker (written here) does; and
    after them, nothing left in flight."""
    ask = {"thinking_token_budget": 4} if ask is None else ask
    out = []
    async with live(redis_url) as (gateway, channel, port):
        for i, (route, body) in enumerate(routes):
            rid = f"rq-{i}"
            raw = json.dumps({"model": "m"} | ask | body).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST %s HTTP/1.0\r\nX-Request-Id: %s\r\nContent-Length: %d\r\n"
                         b"\r\n%s" % (route.encode(), rid.encode(), len(raw), raw))  # fmt: skip
            reading = asyncio.ensure_future(reader.read())  # HTTP/1.0: all, then the end
            while not reading.done() and not gateway.inflight:
                await asyncio.sleep(0.01)
            if not reading.done():  # submitted: its worker answers
                Worker(r, channel, rid).finish("hi", 1)
            head, text = (await reading).split(b"\r\n\r\n", 1)
            writer.close()
            out.append((int(head.split()[1]), text.decode()))
    assert not gateway.inflight
    return out


def test_a_budget_to_a_model_without_markers_is_refused_before_submitting(
    redis_url: str, r: redis.Redis
) -> None:
    # Given workers that published they refuse a thinking budget
    keys = published(r, False)
    # When a budget comes on each generation route
    got = asyncio.run(answers(redis_url, r, ROUTES))
    # Then each is a 400 invalid_request naming the field, and nothing reached the fleet
    for (route, body), (status, text) in zip(ROUTES, got, strict=True):
        assert status == 400, (route, body, text)
        assert "invalid_request" in text and "reasoning markers" in text, (route, text)
    assert json.loads(got[0][1])["error"]["param"] == "thinking_token_budget"
    assert [r.xlen(lane) for lane in keys.lanes(LANES)] == [0] * LANES


@pytest.mark.parametrize("takes", [True, None])
def test_a_budget_to_a_model_that_takes_one_or_says_nothing_is_submitted(
    redis_url: str, r: redis.Redis, takes: bool | None
) -> None:
    keys = published(r, takes)
    asked = [ROUTES[0], ROUTES[2], ROUTES[3]]  # chat, completion, response: whole
    got = asyncio.run(answers(redis_url, r, asked))
    assert [status for status, _ in got] == [200] * len(asked), got
    assert sum(r.xlen(lane) for lane in keys.lanes(LANES)) == len(asked)


def info_of(tiny_lm: Path, **options: Any) -> ModelInfo:
    """The model info a worker of the tiny model with ``options`` publishes, as read back."""
    from batchfleet.schemas.messages import Limits
    from batchfleet.worker.runner_info import model_info
    from batchfleet.worker.runners.generation import TextGenerationRunner
    from conftest import TINY_LM_OPTIONS
    from devices import DEVICE

    lm = TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                              options=TINY_LM_OPTIONS | options)  # fmt: skip
    return decode_model_info(model_info(lm, Limits(), 0).model_dump_json())


def test_the_model_info_tells_whether_its_workers_take_a_budget(tiny_lm: Path) -> None:
    assert info_of(tiny_lm).thinking_token_budget is False
    marked = info_of(tiny_lm, reasoning_config={"reasoning_end_str": "</s>"})
    assert marked.thinking_token_budget is True
    assert decode_model_info('{"task": "text-generation"}').thinking_token_budget is None
