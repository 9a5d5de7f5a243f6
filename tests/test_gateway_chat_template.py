"""A request's own ``chat_template`` to a model whose workers publish that they do not
trust one (``ModelInfo.trust_request_chat_template`` false) is a 400 from the gateway
itself, in vLLM's words, on each route that takes one, with nothing submitted; a model
whose workers trust one, or say nothing (older workers), is asked as before."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis
from batchfleet.schemas.chat import UNTRUSTED_TEMPLATE
from batchfleet.schemas.model_info import decode_model_info
from test_gateway_think_budget import CHAT, LANES, answers, info_of, published

TEMPLATE = {"chat_template": "{{ messages[0]['content'] }}"}
ROUTES = [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
    ("/tokenize", {"messages": CHAT}),
]


def test_an_untrusted_template_is_refused_before_submitting(redis_url: str, r: redis.Redis) -> None:
    # Given workers that published they do not trust a request's template
    keys = published(r, None, trust_request_chat_template=False)
    # When a chat with its own template comes on each route that takes one
    got = asyncio.run(answers(redis_url, r, ROUTES, TEMPLATE))
    # Then each is a 400 invalid_request in vLLM's words, and nothing reached the fleet
    for (route, _), (status, text) in zip(ROUTES, got, strict=True):
        assert status == 400, (route, text)
        error = json.loads(text)["error"]
        assert (error["message"], error["code"], error["param"]) == (
            UNTRUSTED_TEMPLATE, "invalid_request", "chat_template"), route  # fmt: skip
    assert [r.xlen(lane) for lane in keys.lanes(LANES)] == [0] * LANES
    # a chat without its own template is asked as ever
    assert [s for s, _ in asyncio.run(answers(redis_url, r, ROUTES[:1], {}))] == [200]


@pytest.mark.parametrize("trusts", [True, None])
def test_a_template_to_workers_that_trust_one_or_say_nothing_is_submitted(
    redis_url: str, r: redis.Redis, trusts: bool | None
) -> None:
    keys = published(r, None, trust_request_chat_template=trusts)
    got = asyncio.run(answers(redis_url, r, ROUTES[:1], TEMPLATE))
    assert [status for status, _ in got] == [200], got
    assert sum(r.xlen(lane) for lane in keys.lanes(LANES)) == 1


def test_the_model_info_tells_whether_its_workers_trust_a_template(tiny_lm: Path) -> None:
    assert info_of(tiny_lm).trust_request_chat_template is False
    assert info_of(tiny_lm, trust_request_chat_template=True).trust_request_chat_template is True
    assert decode_model_info('{"task": "text-generation"}').trust_request_chat_template is None
