"""The gateway's control broadcasts (``fleet_control.py``): which workers it waits for (the
model's, by their recent heartbeats), that the wait ends once each of them replied, and
that one that did not reply in time is named in the answer (504, ``missing_workers``)
rather than taken for absent. Replies are scripted (no Celery worker, no clock)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import redis
from batchfleet.producer.gateway.dev_routes import DevAdmin
from batchfleet.producer.gateway.fleet_control import live_workers
from batchfleet.producer.gateway.lora_admin import LoraAdmin
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.model_info import ModelInfo
from broker_fakes import Broker, scripted_broker
from gateway_fakes import ScriptedWorker, gateway_cli, gateway_in_process, http

from batchfleet import remote
from batchfleet.connection import connect_async
from batchfleet.control_wait import HEARTBEAT_WINDOW_MS

GEN = ModelInfo(task="text-generation", max_model_len=2048)
LOADED = {"ok": "…", "models": ["lm"], "lora_adapters": {"lm": ["x"]}}


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Broker]:
    return lambda *replies: scripted_broker(monkeypatch, *replies)


def test_the_wait_ends_once_every_expected_worker_replied(broker: Callable[..., Broker]) -> None:
    # Given two workers of the model, a worker of another model and a late one
    app = broker({"w1@h": LOADED}, {"enc@h": {"ok": "no loop", "models": []}},
                 {"h2": LOADED | {"consumer": "w2"}}, {"w3@h": LOADED})  # fmt: skip
    # When the broadcast waits for w1 and w2
    got = remote.send_to_all("redis://x", "bf_load_lora", {}, timeout=5, expect=["w1", "w2"])
    # Then it ends at w2's reply (by its consumer name), and has every reply until then
    assert app.delivered == 3 and list(got) == ["w1@h", "enc@h", "h2"]
    # and waiting for one that never replies, it takes every reply until the wait ends
    app = broker({"w1@h": LOADED})
    assert remote.send_to_all("redis://x", "c", {}, expect=["w1", "gone"]) == {"w1@h": LOADED}
    assert app.delivered == 1


def test_the_workers_waited_for_are_those_of_the_model_with_a_recent_heartbeat(
    redis_url: str, r: redis.Redis
) -> None:
    seconds, micros = r.time()
    now = seconds * 1000 + micros // 1000
    r.hset(ModelKeys("lm").workers, mapping={"w1": now, "w2": now - HEARTBEAT_WINDOW_MS + 500,
                                             "dead": now - HEARTBEAT_WINDOW_MS - 500})  # fmt: skip
    r.hset(ModelKeys("enc").workers, mapping={"w1": now, "e1": now})

    async def go() -> None:
        client = connect_async(redis_url)
        try:
            assert await live_workers(client, ["lm"]) == ["w1", "w2"]
            assert await live_workers(client, ["lm", "enc"]) == ["e1", "w1", "w2"]
            assert await live_workers(client, ["other"]) == []
        finally:
            await client.aclose()

    asyncio.run(go())


def test_the_window_is_the_fleet_s_heartbeat_timeout_as_workers_publish_it_or_the_option(
    redis_url: str, r: redis.Redis
) -> None:
    # Given lm's workers, which published a 20 s heartbeat timeout (their fleet file's),
    # one of them silent for 10 s; and enc's, whose workers published none (older ones)
    seconds, micros = r.time()
    now = seconds * 1000 + micros // 1000
    r.set(ModelKeys("lm").heartbeat_timeout, 20_000)
    r.hset(ModelKeys("lm").workers, mapping={"w1": now, "slow": now - 10_000})
    r.hset(ModelKeys("enc").workers, mapping={"e1": now, "e2": now - 10_000})
    r.set(ModelKeys("odd").heartbeat_timeout, "soon")
    r.hset(ModelKeys("odd").workers, mapping={"o1": now - HEARTBEAT_WINDOW_MS + 500})

    async def go() -> None:
        client = connect_async(redis_url)
        try:
            # Then the one silent for 10 s is live for lm (its 20 s), not for enc (6 s)
            assert await live_workers(client, ["lm", "enc"]) == ["e1", "slow", "w1"]
            # an unreadable value is the default's
            assert await live_workers(client, ["odd"]) == ["o1"]
            # and the gateway's option wins over what workers published
            admin = LoraAdmin("redis://b", heartbeat_window_ms=30_000)
            assert await admin.live(client, ["enc"]) == ["e1", "e2"]
            assert await live_workers(client, ["lm"], 5_000) == ["w1"]
        finally:
            await client.aclose()

    asyncio.run(go())


def test_a_worker_that_replies_after_the_wait_is_named_not_taken_for_absent(
    redis_url: str, r: redis.Redis
) -> None:
    # Given two live workers of lm (their heartbeats) and one of enc
    ScriptedWorker(r, "lm", info=GEN)
    ScriptedWorker(r, "enc", info=ModelInfo(task="embedding"))
    seconds, _ = r.time()
    r.hset(ModelKeys("lm").workers, mapping={"w1": seconds * 1000, "w2": seconds * 1000})
    r.hset(ModelKeys("enc").workers, "e1", seconds * 1000)
    asked: list[tuple[str, dict[str, Any], float, list[str]]] = []

    def send(url: str, command: str, arguments: dict[str, Any], *, timeout: float,
             expect: Sequence[str]) -> dict[str, Any]:  # fmt: skip
        """w2 is busy: its reply comes after the wait (never, here)."""
        asked.append((command, arguments, timeout, list(expect)))
        reply = LOADED if command == "bf_load_lora" else {"ok": "…", "models": ["lm", "enc"]}
        return {"w1@h": reply, "e1@h": {"ok": "…", "models": ["enc"]}}

    async def go() -> None:
        async with gateway_in_process(redis_url, lora_admin=LoraAdmin("redis://b", 7.0, send),
                                      dev_admin=DevAdmin("redis://b", 7.0, send)) as port:  # fmt: skip
            # When the adapter is loaded
            body = {"model": "lm", "lora_name": "x", "lora_path": "/a"}
            status, raw = await http(port, "POST", "/v1/load_lora_adapter", body)
            # Then the broadcast waited for lm's workers, as long as configured
            sent = {"name": "x", "path": "/a", "model": "lm"}
            assert asked[-1] == ("bf_load_lora", sent, 7.0, ["w1", "w2"])
            # and the answer names w2, which did not reply in time (not a success)
            error = json.loads(raw)["error"]
            assert (status, error["code"], error["missing_workers"]) == (504, "timeout", ["w2"])
            assert "loaded by w1@h; w2 did not reply within 7 s" in error["message"]
            # and so does resetting every model's prefix caches (e1 replied: not missing)
            status, raw = await http(port, "POST", "/reset_prefix_cache")
            error = json.loads(raw)["error"]
            assert (status, error["missing_workers"]) == (504, ["w2"]), raw
            assert asked[-1][2:] == (7.0, ["e1", "w1", "w2"])
            # and with w2's heartbeat gone stale, nobody is missing
            r.hset(ModelKeys("lm").workers, "w2", seconds * 1000 - 2 * HEARTBEAT_WINDOW_MS)
            status, raw = await http(port, "POST", "/v1/load_lora_adapter", body)
            assert (status, asked[-1][3]) == (200, ["w1"]), raw

    asyncio.run(go())


def test_the_wait_is_a_gateway_setting_for_both_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = gateway_cli(monkeypatch)
    url = "redis://127.0.0.1:1/0"
    on = gateway("--redis-url", url, "--allow-runtime-lora-updating", "--server-dev-mode",
                 "--control-timeout", "90")  # fmt: skip
    assert (on["lora_admin"], on["dev_admin"]) == (LoraAdmin(url, 90.0), DevAdmin(url, 90.0))
    monkeypatch.setenv("BATCHFLEET_CONTROL_TIMEOUT", "45")
    on = gateway("--redis-url", url, "--server-dev-mode")
    assert on["dev_admin"] == DevAdmin(url, 45.0)
    # the heartbeat window: none given, the workers' published timeout; else in seconds
    on = gateway("--redis-url", url, "--server-dev-mode", "--heartbeat-window", "12.5")
    assert on["dev_admin"] == DevAdmin(url, 45.0, heartbeat_window_ms=12_500)
    monkeypatch.setenv("BATCHFLEET_HEARTBEAT_WINDOW", "20")
    on = gateway("--redis-url", url, "--allow-runtime-lora-updating")
    assert on["lora_admin"] == LoraAdmin(url, 45.0, heartbeat_window_ms=20_000)
