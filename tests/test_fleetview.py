"""``batchfleet trace`` and ``status --json``: what Redis holds about requests and lanes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import encode_request
from batchfleet.schemas.keys import GROUP, ModelKeys, WebhookKeys
from batchfleet.schemas.messages import Request
from batchfleet.schemas.model_info import ModelInfo
from batchfleet.webhooks.tasks import Delivery
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runners.embedding import EmbeddingRunner
from batchfleet.worker.streams import ModelStreams
from rich.console import Console

from batchfleet import cli
from batchfleet.config import ModelConfig, WorkerConfig
from batchfleet.status import print_status
from batchfleet.trace import render, trace

MODEL = "tiny"
KEYS = ModelKeys(MODEL)


def request(rid: str) -> dict[bytes, bytes]:
    return encode_request(Request(id=rid, model=MODEL, inputs=["the dog"]))


def test_trace_follows_a_request_from_its_lane_to_its_result(
    r: redis.Redis, tiny_embedder: Path
) -> None:
    # Given a request queued before any worker exists
    producer = Producer(client=r)
    job = producer.submit(MODEL, "the quick brown fox", priority=2)
    waiting = trace(r, MODEL, job.id)
    assert (waiting.state, waiting.lane, waiting.consumer) == ("waiting", 2, None)
    assert waiting.entry_id and waiting.entered_at_ms

    # When a worker answers it
    handler = EmbeddingRunner(tiny_embedder, device="cpu", max_tokens=32)
    BatchLoop(
        MODEL, ModelConfig(path="/unused", max_tokens=32), handler, r,
        consumer="w-trace", worker=WorkerConfig(block_ms=50), burst=True,
    ).run()  # fmt: skip
    result = job.result(timeout=5)

    # Then the trace shows the worker, the batch and the timings of the stored result
    done = trace(r, MODEL, job.id)
    assert (done.state, done.status, done.consumer) == ("answered", "ok", "w-trace")
    assert done.timings is not None
    assert done.timings["batch_id"] == result.timings.batch_id != ""
    assert done.timings["total_ms"] == result.timings.total_ms
    assert done.finished_at_ms == result.finished_at_ms and done.result_ttl_ms
    assert abs(done.entered_at_ms - waiting.entered_at_ms) <= 2  # type: ignore[operator]
    text = render(done)
    assert "w-trace" in text and result.timings.batch_id in text and "inference" in text


def test_trace_of_a_held_request_shows_its_consumer_and_deliveries(r: redis.Redis) -> None:
    streams = ModelStreams(r, MODEL, 3, "w-held")
    streams.ensure_groups()
    entry_id = r.xadd(KEYS.lane(0), request("held-1")).decode()
    streams.read({0: 1}, None)
    # a second delivery, as when another worker reclaims it after a crash
    r.xclaim(KEYS.lane(0), GROUP, "w-other", 0, [entry_id])

    held = trace(r, MODEL, "held-1")
    assert (held.state, held.lane, held.entry_id) == ("in progress", 0, entry_id)
    assert (held.consumer, held.deliveries) == ("w-other", 2)


def test_trace_of_a_dead_letter_and_its_webhook(
    r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    streams = ModelStreams(r, MODEL, 3, "w-dead")
    streams.ensure_groups()
    r.xadd(KEYS.lane(1), request("dead-1"))
    (entry,) = streams.read({1: 1}, None)
    dead_id = streams.dead_letter(entry, "poisoned", "crashed the worker twice", "w-dead", 100)
    delivery = Delivery(
        model=MODEL, request_id="dead-1", url="https://example.com/h", webhook_id="msg_1"
    )
    member = json.dumps({"kwargs": delivery.model_dump(), "retries": 3}, sort_keys=True)
    r.zadd(WebhookKeys().scheduled, {member: 1_900_000_000_000})

    assert cli.main(["trace", MODEL, "dead-1", "--json", "--redis-url", redis_url]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["state"] == "dead letter" and found["lane"] == 1
    assert found["dead_letter"]["id"] == dead_id and found["dead_letter"]["code"] == "poisoned"
    assert found["webhook"] == {"state": "retry scheduled", "url": "https://example.com/h",
                                "retries": 3, "due_ms": 1_900_000_000_000}  # fmt: skip

    assert cli.main(["trace", MODEL, "never-sent", "--redis-url", redis_url]) == 1
    assert "nothing found" in capsys.readouterr().out


def test_status_json(r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    r.set(KEYS.lanes_key, 2)
    r.xadd(KEYS.lane(1), request("a"))
    r.xadd(KEYS.dead, {"source": KEYS.lane(0), "code": "invalid_request"})
    r.hset(KEYS.workers, "w9", 0)  # a heartbeat from long ago

    assert cli.main(["status", "--json", "--redis-url", redis_url]) == 0
    status = json.loads(capsys.readouterr().out)
    (model,) = status["models"]
    assert model["model"] == MODEL and model["dead_letters"] == 1
    assert [(lane["lane"], lane["length"], lane["lag"]) for lane in model["lanes"]] == [
        (0, 0, 0),
        (1, 1, 1),
    ]
    assert (model["task"], model["max_model_len"]) == (None, None)  # no info: older workers
    (worker,) = status["workers"]
    assert worker["worker"] == "w9" and worker["state"] == "stale"
    # Once a worker published the model's info, its task and context length show
    r.set(KEYS.info, ModelInfo(task="text-generation", max_model_len=4096).model_dump_json())
    assert cli.main(["status", "--json", "--redis-url", redis_url]) == 0
    (model,) = json.loads(capsys.readouterr().out)["models"]
    assert (model["task"], model["max_model_len"]) == ("text-generation", 4096)
    out = io.StringIO()
    print_status(redis_url, workers=False, console=Console(file=out, width=160))
    table = out.getvalue()
    assert "text-generation" in table and "4096" in table


def test_models_are_found_in_the_set_workers_announce_them_in(r: redis.Redis) -> None:
    from batchfleet.schemas.keys import MODELS_KEY

    from batchfleet.fleetview import discover_models

    try:
        # An older worker wrote only its lanes key: found by a SCAN
        r.set(ModelKeys("older").lanes_key, 3)
        assert "older" in discover_models(r)
        # A worker of today announces its model in the set, which is read instead
        ModelStreams(r, "newer", 3, "w").ensure_groups()
        assert r.smembers(MODELS_KEY) == {b"newer"}
        assert discover_models(r) == ["newer"]
    finally:
        r.delete(MODELS_KEY, ModelKeys("older").lanes_key, ModelKeys("newer").lanes_key)
