"""vLLM's ``--fingerprint-mode`` on the gateway (``full``, ``hash``, ``custom``, ``none``): the
rule as a table, the serving hash workers publish, then the gateway in-process against a
real Redis with the test playing the model's workers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis
from batchfleet.producer.gateway.fingerprint import Fingerprints, fingerprint
from batchfleet.producer.gateway.frontend import Frontend
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Limits, Result
from batchfleet.schemas.model_info import ModelInfo, WorkerServing
from batchfleet.worker.runner_info import model_info
from gateway_fakes import ScriptedWorker, gateway_cli, gateway_in_process, http

from batchfleet import __version__
from batchfleet.config import ModelConfig
from batchfleet.connection import connect_async

HASH = "0123456789abcdef" * 4
INFO = ModelInfo(task="text-generation", version="1.2.3", config_hash=HASH)


@pytest.mark.parametrize(
    ("mode", "info", "dp", "expected"),
    [
        ("full", INFO, 1, "batchfleet-1.2.3-01234567"),
        ("full", INFO, 3, "batchfleet-1.2.3-dp3-01234567"),
        ("hash", INFO, 3, "batchfleet-1.2.3-01234567"),
        ("custom", INFO, 3, "fp-7"),
        ("none", INFO, 3, None),
        ("full", ModelInfo(task="text-generation"), 3, None),  # workers before the hash
        ("hash", None, 1, None),  # no info at all
        ("full", ModelInfo(task="embedding", config_hash=HASH), 1, "batchfleet-unknown-01234567"),
        ("full", WorkerServing(version="2", config_hash=HASH), 2, "batchfleet-2-dp2-01234567"),
    ],
)
def test_the_fingerprint_of_each_mode(
    mode: str, info: ModelInfo | WorkerServing | None, dp: int, expected: str | None
) -> None:
    frontend = Frontend(system_fingerprint="fp-7", fingerprint_mode=mode, data_parallel_size=dp)
    assert fingerprint(frontend, info) == expected


def test_workers_publish_a_serving_hash_that_what_decides_answers_changes() -> None:
    class Runner:
        name = "embedding"
        max_tokens = 32

    config = ModelConfig(runner="embedding", path="/m", options={"pooling": "mean"})
    info = model_info(Runner(), Limits(), 1, config)  # type: ignore[arg-type]
    assert (info.version, info.config_hash) == (__version__, config.serving_hash(__version__))
    assert model_info(Runner(), Limits(), 1).config_hash is None  # type: ignore[arg-type]
    # scheduling leaves it (a live policy change, lanes, limits); the answers' inputs do not
    same = config.model_copy(update={"lanes": 2, "result_ttl_s": 5}, deep=True)
    same.batch.max_batch_size = 4
    assert same.serving_hash("1") == config.serving_hash("1")
    for changed in ({"dtype": "float16"}, {"path": "/n"}, {"options": {"pooling": "cls"}},
                    {"device": "cuda:1"}, {"max_tokens": 64}):  # fmt: skip
        assert config.model_copy(update=changed).serving_hash("1") != config.serving_hash("1")
    assert config.serving_hash("2") != config.serving_hash("1")


def test_answers_carry_the_fingerprint_of_the_mode(redis_url: str) -> None:
    # Given a model whose workers publish their serving hash, two of them live
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "mm", info=INFO)
    seconds, _ = client.time()
    client.hset(ModelKeys("mm").workers, mapping={"w1": seconds * 1000, "w2": seconds * 1000})
    chat = {"model": "mm", "messages": [{"role": "user", "content": "hi"}]}
    out = {"text": "Hi!", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 2}

    async def ask(port: int, path: str, body: dict[str, Any]) -> Any:
        sent = asyncio.ensure_future(http(port, "POST", path, body))
        taken = await asyncio.to_thread(fake.take)
        answer = Result(id=taken.id, model="mm", status="ok", outputs=[out])
        await asyncio.to_thread(fake.answer, taken, answer)
        status, raw = await sent
        assert status == 200, raw
        return json.loads(raw)

    async def go() -> None:
        # When answered under each mode
        for mode, dp, expected in (("full", 1, "batchfleet-1.2.3-01234567"),
                                   ("full", 4, "batchfleet-1.2.3-dp4-01234567"),
                                   ("hash", 4, "batchfleet-1.2.3-01234567"),
                                   ("none", 1, None)):  # fmt: skip
            # (two workers live: the deployed size, not the live count, is the dp)
            frontend = Frontend(fingerprint_mode=mode, data_parallel_size=dp)
            async with gateway_in_process(redis_url, frontend=frontend) as port:
                # Then chat and text completions carry the model's fingerprint
                answer = await ask(port, "/v1/chat/completions", chat)
                assert answer["system_fingerprint"] == expected, mode
                text = await ask(port, "/v1/completions", {"model": "mm", "prompt": "a"})
                assert text["system_fingerprint"] == expected, mode

    try:
        asyncio.run(go())
    finally:
        client.close()


def test_the_mode_is_a_gateway_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = gateway_cli(monkeypatch)
    url = "redis://127.0.0.1:1/0"
    assert gateway("--redis-url", url)["frontend"].fingerprint_mode == "full"  # vLLM's default
    on = gateway("--redis-url", url, "--fingerprint-mode", "hash")["frontend"]
    assert (on.fingerprint_mode, on.system_fingerprint) == ("hash", None)
    monkeypatch.setenv("BATCHFLEET_FINGERPRINT_MODE", "none")
    assert gateway("--redis-url", url)["frontend"].fingerprint_mode == "none"


OTHER = "fedcba9876543210" * 4


def test_the_fingerprint_is_most_live_workers_config_and_stays_as_workers_come_and_go(
    redis_url: str, r: redis.Redis
) -> None:
    # Given live workers of one model on two fleet-file entries (two serving hashes)
    keys = ModelKeys("mm")
    seconds, _ = r.time()
    now = seconds * 1000

    def start(name: str, version: str, config_hash: str, beat: int = now) -> None:
        card = WorkerServing(version=version, config_hash=config_hash, heartbeat_timeout_ms=6000)
        r.hset(keys.workers, name, beat)
        r.hset(keys.serving, name, card.model_dump_json())

    start("w1", "1.2.3", HASH)
    start("w2", "1.2.3", HASH)
    start("w3", "1.2.4", OTHER)
    info = ModelInfo(task="text-generation", version="1.2.4", config_hash=OTHER)  # the last's

    async def go() -> None:
        client = connect_async(redis_url)
        fps = Fingerprints(Frontend(), client, lambda m: asyncio.sleep(0, info), cache_s=60.0)
        try:
            # Then the fingerprint is the majority's, not the last worker started's
            assert await fps.of("mm") == "batchfleet-1.2.3-01234567"
            assert await fps.configs("mm") == {HASH: 2, OTHER: 1}
            # a fourth worker starts: the fingerprint stays (no live count in it)
            start("w4", "1.2.3", HASH)
            fps.cache_s = 0.0
            assert await fps.of("mm") == "batchfleet-1.2.3-01234567"
            # the majority's heartbeats stop: the live ones' config takes over
            for name in ("w1", "w2", "w4"):
                r.hset(keys.workers, name, now - 60_000)
            assert await fps.of("mm") == "batchfleet-1.2.4-fedcba98"
            assert await fps.configs("mm") == {OTHER: 1}
            # a tie: the smallest hash
            start("w5", "1.2.3", HASH)
            assert await fps.of("mm") == "batchfleet-1.2.3-01234567"
            # Redis unreachable: the answer keeps the last read rather than failing
            fps.client = connect_async("redis://127.0.0.1:1/0")
            assert await fps.of("mm") == "batchfleet-1.2.3-01234567"
            await fps.client.aclose()
            # workers older than the serving hash: the model's info
            fps.client = client
            r.delete(keys.serving)
            assert await fps.of("mm") == "batchfleet-1.2.4-fedcba98"
        finally:
            await client.aclose()

    asyncio.run(go())


def test_models_warn_of_a_mixed_fleet(redis_url: str, r: redis.Redis) -> None:
    # Given a model whose live workers serve it with one configuration, then two
    ScriptedWorker(r, "mm", info=INFO)
    keys = ModelKeys("mm")
    seconds, _ = r.time()
    r.hset(keys.workers, mapping={"w1": seconds * 1000, "w2": seconds * 1000})
    r.hset(keys.serving, "w1", WorkerServing(version="1", config_hash=HASH).model_dump_json())

    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            status, raw = await http(port, "GET", "/v1/models/mm")
            assert status == 200, raw
            card = json.loads(raw)
            assert "warning" not in card and "serving_hashes" not in card
        r.hset(keys.serving, "w2", WorkerServing(version="1", config_hash=OTHER).model_dump_json())
        async with gateway_in_process(redis_url) as port:
            # Then its card says so, with each configuration's workers
            status, raw = await http(port, "GET", "/v1/models")
            card = json.loads(raw)["data"][0]
            assert card["serving_hashes"] == {HASH: 1, OTHER: 1}
            assert "mixed fleet" in card["warning"] and "01234567 (1)" in card["warning"]

    asyncio.run(go())


def test_the_deployed_size_is_a_gateway_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = gateway_cli(monkeypatch)
    url = "redis://127.0.0.1:1/0"
    assert gateway("--redis-url", url)["frontend"].data_parallel_size == 1
    assert (
        gateway("--redis-url", url, "--data-parallel-size", "4")["frontend"].data_parallel_size == 4
    )
    monkeypatch.setenv("BATCHFLEET_DATA_PARALLEL_SIZE", "3")
    assert gateway("--redis-url", url)["frontend"].data_parallel_size == 3
    monkeypatch.setenv("BATCHFLEET_DATA_PARALLEL_SIZE", "three")
    with pytest.raises(SystemExit):  # argparse's: not a whole number
        gateway("--redis-url", url)
