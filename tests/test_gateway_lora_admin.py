"""vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on the gateway
(``--allow-runtime-lora-updating``): a Celery broadcast to a real worker, whose model info
the gateway's ``/v1/models`` then shows; the answer from the replies (:func:`verdict`);
which base model a body without ``model`` means; off by default (404)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.gateway.lora_admin import LoraAdmin, verdict
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.model_info import ModelInfo
from conftest import WorkerProcess
from gateway_fakes import ScriptedWorker, gateway_cli, gateway_in_process, http

from batchfleet.control_wait import Replies

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
GEN = ModelInfo(task="text-generation", max_model_len=2048)


def _ok(*adapters: str) -> dict[str, Any]:
    return {"ok": "…", "models": ["gen"], "lora_adapters": {"gen": list(adapters)}}


def _no(code: str, why: str = "why") -> dict[str, Any]:
    return {"error": f"gen: {why}", "code": code}


ELSEWHERE = {"ok": "no loop for 'gen' here", "models": []}
OLD_WORKER = {"error": "gen: adapter 'x' (/a): cannot read adapter_config.json"}
"""A worker older than the reply's ``code``."""


WEBHOOKS = {"error": "KeyError('bf_load_lora')"}
"""A Celery worker on the broker that is no batchfleet worker (no heartbeat of the model)."""


@pytest.mark.parametrize(
    ("replies", "missing", "load", "status", "says"),
    [
        ({"a": _ok("x"), "b": _ok("x"), "c": ELSEWHERE}, (), True, 200, "'x' added successfully"),
        ({"a": _ok(), "b": ELSEWHERE}, (), False, 200, "'x' removed successfully"),
        # unloaded where some had it: gone from every worker
        ({"a": _ok(), "b": _no("not_loaded")}, (), False, 200, "'x' removed successfully"),
        ({"a": _no("not_loaded"), "b": _no("not_loaded")}, (), False, 404, "cannot be found"),
        ({"a": _no("already_loaded")}, (), True, 400, "has already been loaded. (a: gen: why)"),
        ({"a": _no("refused", "bad dir"), "b": _no("refused", "x")}, (), True, 400,
         "a: gen: bad dir; b"),
        ({"a": OLD_WORKER}, (), True, 400, "a: gen: adapter 'x' (/a): cannot read"),
        ({"a": _ok("x"), "b": _no("refused", "no dir")}, (), True, 500, "loaded by a but not by"),
        ({"a": _ok("x"), "b": _no("already_loaded")}, (), True, 500, "b: gen: why"),
        ({"a": _ok(), "b": _no("refused")}, (), False, 500, "unloaded by a but not by"),
        ({"a": _ok("x"), "w": WEBHOOKS}, (), True, 200, "'x' added successfully"),  # not ours
        ({"c": ELSEWHERE}, (), True, 503, "no worker of 'gen' is live"),
        ({}, (), False, 503, "no worker of 'gen' is live"),
        # a live worker that did not reply in time is named, never taken for absent
        ({"a": _ok("x"), "c": ELSEWHERE}, ("b",), True, 504,
         "loaded by a; b did not reply within 30 s"),
        ({}, ("a", "b"), True, 504, "loaded by none; a, b did not reply within 30 s"),
        ({"a": _ok(), "b": _no("not_loaded")}, ("d",), False, 504, "unloaded by a; d did not"),
        ({"a": _no("already_loaded")}, ("b",), True, 504, "refused by a: gen: why; b did not"),
        ({"a": _ok("x"), "b": _no("refused", "no dir")}, ("d",), True, 500,
         "loaded by a but not by the others: b: gen: no dir; d did not reply within 30 s"),
    ],
)  # fmt: skip
def test_the_answer_comes_from_the_replies_of_the_model_s_workers(
    replies: dict[str, Any], missing: tuple[str, ...], load: bool, status: int, says: str
) -> None:
    # Given the live workers of the model: those that replied, and the missing ones
    expected = tuple(h for h in replies if h not in ("c", "w")) + missing
    try:
        text = verdict(Replies(replies, expected, missing, 30.0), "gen", "x", load)
    except ApiError as exc:
        assert (exc.status, says in exc.message) == (status, True), exc.message
        assert exc.extra.get("missing_workers", []) == list(missing)
        return
    assert status == 200 and says in text


def test_the_routes_are_off_by_default(redis_url: str) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            for path in (LOAD, UNLOAD):
                status, raw = await http(port, "POST", path, {"lora_name": "x", "lora_path": "/"})
                assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"

    asyncio.run(go())


def test_the_base_model_is_named_where_the_fleet_serves_several(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    workers = [ScriptedWorker(client, "lm", info=GEN), ScriptedWorker(client, "lm2", info=GEN),
               ScriptedWorker(client, "enc", info=ModelInfo(task="embedding"))]  # fmt: skip
    admin = LoraAdmin(redis_url, timeout_s=5.0)

    async def go() -> None:
        async with gateway_in_process(redis_url, lora_admin=admin) as port:
            load = {"lora_name": "x", "lora_path": "/adapters/x"}
            status, raw = await http(port, "POST", LOAD, load)
            error = json.loads(raw)["error"]
            assert (status, error["param"]) == (400, "model")
            assert "several generation models (lm, lm2)" in error["message"]
            status, raw = await http(port, "POST", LOAD, load | {"model": "nope"})
            assert (status, json.loads(raw)["error"]["code"]) == (404, "model_not_found")
            for bad, param in (({"lora_path": "/a"}, "lora_name"), ({"lora_name": ""}, "lora_name"),
                               ({"lora_name": "x"}, "lora_path"),
                               ({"lora_name": "x", "lora_path": 3}, "lora_path")):  # fmt: skip
                status, raw = await http(port, "POST", LOAD, bad | {"model": "lm"})
                assert (status, json.loads(raw)["error"]["param"]) == (400, param), raw
            status, raw = await http(port, "POST", UNLOAD, {"model": "lm"})
            assert (status, json.loads(raw)["error"]["param"]) == (400, "lora_name")

    try:
        asyncio.run(go())
    finally:
        del workers
        client.close()


def test_adapters_are_loaded_and_unloaded_through_the_gateway(
    redis_url: str, r: redis.Redis, tmp_path: Path, start_worker: Callable[..., WorkerProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:  # fmt: skip
    pytest.importorskip("peft")
    from test_generation_lora import sql_and_chat, start_gen_worker
    from tiny_models import make_causal_lm

    lm = make_causal_lm(tmp_path_factory.mktemp("lm"))
    adapters = sql_and_chat(lm, tmp_path_factory.mktemp("adapters"))
    start_gen_worker(redis_url, r, lm, adapters["sql"], start_worker)
    other = ScriptedWorker(r, "lm2", info=GEN)  # no worker of it answers broadcasts
    admin = LoraAdmin(redis_url, timeout_s=30.0)

    async def models(port: int) -> dict[str, Any]:
        status, raw = await http(port, "GET", "/v1/models")
        assert status == 200
        return {c["id"]: c for c in json.loads(raw)["data"]}

    async def complete(port: int, model: str) -> tuple[int, dict[str, Any]]:
        body = {"model": model, "prompt": "the man was", "max_tokens": 4}
        status, raw = await http(port, "POST", "/v1/completions", body)
        return status, json.loads(raw)

    async def go(port: int) -> None:
        assert "chat" not in await models(port)
        # When: a directory the worker cannot read: 400 with its reason, nothing changes
        status, raw = await http(port, "POST", LOAD, {"model": "gen", "lora_name": "chat",
                                                      "lora_path": str(tmp_path / "nowhere")})  # fmt: skip
        error = json.loads(raw)["error"]
        assert status == 400 and "gen-1@" in error["message"], raw
        assert "adapter_config.json" in error["message"]
        # When: chat is loaded
        status, raw = await http(port, "POST", LOAD, {"model": "gen", "lora_name": "chat",
                                                      "lora_path": str(adapters["chat"])})  # fmt: skip
        # Then: vLLM's answer, /v1/models lists it at once, a request naming it is served
        assert (status, raw.decode()) == (200, "Success: LoRA adapter 'chat' added successfully.")
        assert (await models(port))["chat"]["parent"] == "gen"
        status, answer = await complete(port, "chat")
        assert status == 200 and answer["model"] == "chat", answer
        # loaded already: 400, vLLM's words
        status, raw = await http(port, "POST", LOAD, {"model": "gen", "lora_name": "chat",
                                                      "lora_path": str(adapters["chat"])})  # fmt: skip
        assert status == 400 and "has already been loaded" in json.loads(raw)["error"]["message"]
        # a model no worker of answers the broadcast: 503
        status, raw = await http(port, "POST", LOAD, {"model": "lm2", "lora_name": "chat",
                                                      "lora_path": str(adapters["chat"])})  # fmt: skip
        assert (status, json.loads(raw)["error"]["code"]) == (503, "unavailable"), raw
        # When: sql (the fleet file's) is unloaded
        status, raw = await http(port, "POST", UNLOAD, {"model": "gen", "lora_name": "sql"})
        # Then: gone from /v1/models, and a request naming it is refused
        assert (status, raw.decode()) == (200, "Success: LoRA adapter 'sql' removed successfully.")
        assert "sql" not in await models(port)
        status, answer = await complete(port, "sql")
        assert (status, answer["error"]["code"]) == (404, "model_not_found"), answer
        # unloaded already: 404, vLLM's words
        status, raw = await http(port, "POST", UNLOAD, {"model": "gen", "lora_name": "sql"})
        assert status == 404 and "cannot be found" in json.loads(raw)["error"]["message"]

    async def run() -> None:
        async with gateway_in_process(redis_url, lora_admin=admin) as port:
            await go(port)

    try:
        asyncio.run(run())
    finally:
        del other
    recorded = {b"chat": str(adapters["chat"]).encode(), b"sql": b""}
    assert r.hgetall(ModelKeys("gen").lora) == recorded


def test_the_cli_turns_the_routes_on_with_the_fleet_s_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway = gateway_cli(monkeypatch)
    url = "redis://127.0.0.1:1/0"
    assert gateway("--redis-url", url)["lora_admin"] is None  # off by default
    on = gateway("--redis-url", url, "--allow-runtime-lora-updating", "--lora-timeout", "5")
    assert on["lora_admin"] == LoraAdmin(url, 5.0)
    on = gateway("--redis-url", url, "--allow-runtime-lora-updating",
                 "--broker-url", "redis://control@127.0.0.1:1/1")  # fmt: skip
    assert on["lora_admin"] == LoraAdmin("redis://control@127.0.0.1:1/1", 30.0)
