"""vLLM's development routes on the gateway (``--server-dev-mode``): ``POST
/reset_prefix_cache``, a Celery broadcast to a real worker whose next prompt is then
prefilled whole; the answer from the replies (:func:`reset_verdict`); off by default."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from batchfleet.producer.gateway.dev_routes import DevAdmin, reset_verdict
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.schemas.model_info import ModelInfo
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml
from gateway_fakes import ScriptedWorker, gateway_cli, gateway_in_process, http

from batchfleet.control_wait import Replies

RESET = "/reset_prefix_cache"
DONE = {"ok": "reset_prefix_cache: gen", "models": ["gen"], "cleared": ["gen"]}
NO_CACHE = {"ok": "reset_prefix_cache: no prefix cache here", "models": ["enc"], "cleared": []}
ELSEWHERE = {"ok": "no loop for 'gen' here", "models": []}
OLD_WORKER = {"error": "KeyError('bf_reset_prefix_cache')"}
"""What kombu replies from a worker that has no such command."""


@pytest.mark.parametrize(
    ("replies", "missing", "model", "status", "says"),
    [
        ({"a": DONE, "b": DONE, "c": ELSEWHERE}, (), "gen", 200, ""),
        ({"a": DONE, "b": NO_CACHE}, (), None, 200, ""),  # nothing to empty is no failure
        ({"a": DONE, "b": OLD_WORKER}, (), "gen", 500,
         "reset by a but not by the others: b: KeyError"),
        ({"b": OLD_WORKER}, (), None, 500, "reset by none but not by the others"),
        ({"c": ELSEWHERE}, (), "gen", 503, "no worker of 'gen' is live"),
        ({"b": NO_CACHE}, (), "gen", 503, "no worker of 'gen' is live"),
        ({}, (), None, 503, "no worker is live"),
        # a live worker that did not reply in time is named, never taken for absent
        ({"a": DONE}, ("b",), "gen", 504, "reset by a; b did not reply within 30 s"),
        ({}, ("a",), None, 504, "reset by none; a did not reply within 30 s"),
        ({"a": DONE, "b": OLD_WORKER}, ("d",), "gen", 500, "b: KeyError('bf_reset_prefix_cache'"
         "); d did not reply within 30 s"),
    ],
)  # fmt: skip
def test_the_answer_comes_from_the_replies_of_the_model_s_workers(
    replies: dict[str, Any], missing: tuple[str, ...], model: str | None, status: int, says: str
) -> None:
    expected = tuple(h for h in replies if h != "c" and (model is None or h != "b"
                                                        or replies[h] is OLD_WORKER)) + missing  # fmt: skip
    try:
        reset_verdict(Replies(replies, expected, missing, 30.0), model)
    except ApiError as exc:
        assert (exc.status, says in exc.message) == (status, True), exc.message
        assert exc.extra.get("missing_workers", []) == list(missing)
        return
    assert status == 200


def test_the_route_is_off_by_default(redis_url: str) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            status, raw = await http(port, "POST", RESET)
            assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"

    asyncio.run(go())


def test_reset_prefix_cache_empties_the_workers_caches(
    redis_url: str, r: redis.Redis, start_worker: Callable[..., WorkerProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:  # fmt: skip
    from tiny_models import make_causal_lm

    from batchfleet import cli

    lm = make_causal_lm(tmp_path_factory.mktemp("lm"))
    spec = {"runner": "text-generation", "path": str(lm), "options": TINY_LM_OPTIONS}
    start_worker(fleet_toml(redis_url, {"gen": spec}), "gen-1").wait_ready(r, "gen")
    other = ScriptedWorker(r, "lm2", info=ModelInfo(task="text-generation"))  # none answers
    words = " ".join(f"w{i}" for i in range(40))

    async def cached(port: int) -> int:
        body = {"model": "gen", "prompt": words, "max_tokens": 2}
        status, raw = await http(port, "POST", "/v1/completions", body)
        assert status == 200, raw
        return int(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def go(port: int) -> None:
        # Given a prompt the worker's prefix cache holds (the second time, taken from it)
        assert await cached(port) == 0 and await cached(port) > 0
        # When the caches are reset (every model's, then gen's): vLLM's empty 200
        for query in ("", "?model=gen"):
            status, raw = await http(port, "POST", RESET + query)
            assert (status, raw) == (200, b""), raw
            # Then the same prompt is prefilled whole, and held again after
            assert await cached(port) == 0 and await cached(port) > 0
        # a model no worker serves: 404; one whose workers do not answer: 503
        status, raw = await http(port, "POST", RESET + "?model=nope")
        assert (status, json.loads(raw)["error"]["param"]) == (404, "model"), raw
        status, raw = await http(port, "POST", RESET + "?model=lm2")
        assert (status, json.loads(raw)["error"]["code"]) == (503, "unavailable"), raw
        # and it asks for the key
        assert (await http(port, "POST", RESET, key=None))[0] == 401
        # the CLI's reset-prefix-cache is the same broadcast
        argv = ["reset-prefix-cache", "gen", "--redis-url", redis_url, "--timeout", "2"]
        assert await asyncio.to_thread(cli.main, argv) == 0
        assert await cached(port) == 0

    async def run() -> None:
        async with gateway_in_process(redis_url, dev_admin=DevAdmin(redis_url)) as port:
            await go(port)

    try:
        asyncio.run(run())
    finally:
        del other


def test_the_cli_turns_the_routes_on_with_the_fleet_s_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway = gateway_cli(monkeypatch)
    url = "redis://127.0.0.1:1/0"
    assert gateway("--redis-url", url)["dev_admin"] is None  # off by default
    assert gateway("--redis-url", url, "--server-dev-mode")["dev_admin"] == DevAdmin(url)
    on = gateway("--redis-url", url, "--server-dev-mode",
                 "--broker-url", "redis://control@127.0.0.1:1/1")  # fmt: skip
    assert on["dev_admin"] == DevAdmin("redis://control@127.0.0.1:1/1")
