"""A client written from docs/protocol.md alone: bare redis-py and msgpack/json, no batchfleet
imports in the client code (only the fixtures start the worker)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml

pytestmark = pytest.mark.timeout(120)


def poll(r: redis.Redis, key: str, timeout: float = 30.0) -> bytes:
    end = time.monotonic() + timeout
    while (raw := r.get(key)) is None:
        assert time.monotonic() < end, f"no result at {key}"
        time.sleep(0.005)
    return raw


def test_plain_redis_client(
    redis_url: str, r: redis.Redis, tiny_embedder: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    fleet = fleet_toml(redis_url, {"docs": {"path": str(tiny_embedder), "max_tokens": 64}})
    start_worker(fleet, "raw").wait_ready(r, "docs")

    # lanes come from bf:{model}:lanes
    lanes = int(r.get("bf:{docs}:lanes") or 3)
    assert lanes == 3

    # msgpack request on lane 0, polled
    rid = uuid.uuid4().hex
    body = {"id": rid, "model": "docs", "inputs": ["hello world", "the dog"],
            "metadata": {"user": "ada"}}  # fmt: skip
    r.xadd("bf:{docs}:lane:0", {"msgpack": msgpack.packb(body)})
    result = msgpack.unpackb(poll(r, f"bf:{{docs}}:result:{rid}"))
    assert result["status"] == "ok" and result["id"] == rid
    assert len(result["outputs"]) == 2 and len(result["outputs"][0]) == 32
    assert result["truncated"] == [False, False]
    assert result["usage"]["prompt_tokens"] > 4  # both texts' tokens, [CLS] and [SEP] too
    assert result["metadata"] == {"user": "ada"}
    assert set(result["timings"]) >= {"queued_ms", "batch_wait_ms", "inference_ms", "total_ms",
                                      "batch_size", "batch_id", "worker"}  # fmt: skip

    # JSON request on lane 2, result by subscription on our own channel
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("svc-replies")
    rid2 = "order:" + uuid.uuid4().hex
    body2 = {"id": rid2, "model": "docs", "inputs": ["what a day"], "reply": "svc-replies",
             "deadline_ms": 30000}  # fmt: skip
    r.xadd("bf:{docs}:lane:2", {"json": json.dumps(body2)})
    end = time.monotonic() + 30
    message = None
    while message is None and time.monotonic() < end:
        message = pubsub.get_message(timeout=0.5)
    assert message is not None
    published = json.loads(message["data"])
    assert published["id"] == rid2 and published["status"] == "ok"
    assert json.loads(poll(r, f"bf:{{docs}}:result:{rid2}")) == published
    assert 0 < r.ttl(f"bf:{{docs}}:result:{rid2}") <= 3600

    # an invalid request gets an error result with a stable code
    rid3 = uuid.uuid4().hex
    r.xadd("bf:{docs}:lane:1", {"json": json.dumps({"id": rid3, "model": "docs", "inputs": []})})
    bad = json.loads(poll(r, f"bf:{{docs}}:result:{rid3}"))
    assert bad["status"] == "error" and bad["error"]["code"] == "invalid_request"

    # an entry with no id goes to the dead-letter stream
    r.xadd("bf:{docs}:lane:1", {"json": b"{oops"})
    end = time.monotonic() + 30
    while not r.xlen("bf:{docs}:dead"):
        assert time.monotonic() < end
        time.sleep(0.01)
    ((_, dead),) = r.xrange("bf:{docs}:dead")
    assert dead[b"code"] == b"malformed" and dead[b"orig_json"] == b"{oops"

    # acked entries are deleted: XLEN is the backlog
    assert sum(r.xlen(f"bf:{{docs}}:lane:{n}") for n in range(lanes)) == 0


def read_reply(data: bytes) -> dict[str, object] | None:
    """docs/protocol.md, "What may change within v1": a message on a reply channel is a result
    when it is a map with string `id` and `status`, `v` 1 (or absent) and `kind` absent or
    "result"; anything else is skipped. Unknown keys, statuses and codes are ignored."""
    try:
        body = json.loads(data) if data[:1] == b"{" else msgpack.unpackb(data)
    except Exception:
        return None
    if not isinstance(body, dict) or body.get("kind", "result") != "result":
        return None
    if body.get("v", 1) != 1 or not all(isinstance(body.get(k), str) for k in ("id", "status")):
        return None
    return body


def test_plain_client_reads_a_later_v1_worker(r: redis.Redis) -> None:
    # Given a client waiting on its reply channel for request `rid`
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("svc-later")
    rid = uuid.uuid4().hex

    # When a later v1 worker publishes other message kinds, then a result with a new field,
    # a new status and a new error code
    future = {"v": 1, "id": rid, "model": "docs", "status": "deferred", "eta_ms": 900,
              "error": {"code": "overloaded", "message": "later", "retry_after_ms": 5},
              "timings": {"queued_ms": 0.5, "gpu_ms": 2.0}, "metadata": {}}  # fmt: skip
    r.publish("svc-later", json.dumps({"kind": "progress", "id": rid, "done": 0.5}))
    r.publish("svc-later", msgpack.packb({"v": 2, "id": rid, "status": "ok"}))
    r.publish("svc-later", b"\x00garbage")
    r.publish("svc-later", msgpack.packb(future))

    # Then the client skips the first three and reads the result
    end = time.monotonic() + 30
    result = None
    while result is None:
        assert time.monotonic() < end
        message = pubsub.get_message(timeout=0.5)
        if message is not None:
            result = read_reply(message["data"])
    assert result["id"] == rid and result["status"] not in ("ok", "error", "expired")
    assert result["error"] == {"code": "overloaded", "message": "later", "retry_after_ms": 5}
    pubsub.close()


def read_tokens(r: redis.Redis, key: str, timeout: float = 60.0) -> list[dict[bytes, bytes]]:
    """docs/protocol.md, "Text generation": XREAD the token stream from 0-0, BLOCKing from
    the last id seen, until the `end` entry."""
    last, out = "0-0", []
    end = time.monotonic() + timeout
    while True:
        assert time.monotonic() < end, f"{key} did not end"
        for _, entries in r.xread({key: last}, block=1000) or []:
            for entry_id, fields in entries:
                last = entry_id
                if b"end" in fields:
                    return [*out, fields]
                out.append(fields)


def test_plain_client_generates_streams_and_cancels(
    redis_url: str, r: redis.Redis, tiny_lm: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    fleet = fleet_toml(
        redis_url, {"gen": {"runner": "text-generation", "path": str(tiny_lm),
                            "options": TINY_LM_OPTIONS}}
    )  # fmt: skip
    start_worker(fleet, "raw-gen").wait_ready(r, "gen")
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("svc-gen")

    # a streamed chat request, in JSON
    rid = uuid.uuid4().hex
    body = {"id": rid, "model": "gen", "messages": [{"role": "user", "content": "the man was"}],
            "max_new_tokens": 12, "stream": True, "reply": "svc-gen"}  # fmt: skip
    r.xadd("bf:{gen}:lane:1", {"json": json.dumps(body)})
    entries = read_tokens(r, f"bf:{{gen}}:tokens:{rid}")
    *deltas, last = entries
    assert [int(f[b"seq"]) for f in entries] == list(range(1, len(entries) + 1))
    assert last == {b"life": b"1", b"seq": str(len(entries)).encode(), b"end": b"1"}
    assert all(f[b"life"] == b"1" for f in entries)  # its first attempt
    result = json.loads(poll(r, f"bf:{{gen}}:result:{rid}"))
    (out,) = result["outputs"]
    assert result["status"] == "ok" and out["finish_reason"] in ("stop", "length")
    assert out["text"] == "".join(f[b"text"].decode() for f in deltas)
    assert out["completion_tokens"] == sum(int(f[b"tokens"]) for f in deltas) <= 12
    assert result["usage"]["completion_tokens"] == out["completion_tokens"]
    assert result["usage"]["prompt_tokens"] == out["prompt_tokens"] > 0
    assert result["timings"]["first_token_ms"] > 0
    assert 0 < r.ttl(f"bf:{{gen}}:tokens:{rid}") <= 3600
    # the worker that admitted it said so (its name in the heartbeats), for as long
    started = f"bf:{{gen}}:started:{rid}"
    assert r.get(started) in r.hkeys("bf:{gen}:workers") and 0 < r.ttl(started) <= 3600

    # the reply channel carried the same deltas (kind "delta"), then the result
    published: list[dict[str, object]] = []
    end = time.monotonic() + 30
    while not published or published[-1].get("kind") == "delta":
        assert time.monotonic() < end, f"no result on the reply channel after {published}"
        if (message := pubsub.get_message(timeout=0.5)) is not None:
            published.append(json.loads(message["data"]))
    *messages, final = published
    assert [m["seq"] for m in messages] == [int(f[b"seq"]) for f in deltas]
    assert "".join(str(m["text"]) for m in messages) == out["text"]
    assert all(m["v"] == 1 and m["id"] == rid and m["model"] == "gen" for m in messages)
    assert read_reply(message["data"]) == final == result  # an old client reads only this

    # cancelling a long generation once it has started, in msgpack
    rid2 = uuid.uuid4().hex
    body2 = {"id": rid2, "model": "gen", "inputs": ["a b c"], "max_new_tokens": 900,
             "stream": True}  # fmt: skip
    r.xadd("bf:{gen}:lane:0", {"msgpack": msgpack.packb(body2)})
    first = r.xread({f"bf:{{gen}}:tokens:{rid2}": "0-0"}, count=1, block=30_000)
    assert first, "no token within 30 s"
    r.set(f"bf:{{gen}}:cancel:{rid2}", "1", ex=3600)
    entries2 = read_tokens(r, f"bf:{{gen}}:tokens:{rid2}")
    cancelled = msgpack.unpackb(poll(r, f"bf:{{gen}}:result:{rid2}"))
    (out2,) = cancelled["outputs"]
    assert cancelled["status"] == "ok" and out2["finish_reason"] == "cancelled"
    assert out2["text"] == "".join(f[b"text"].decode() for f in entries2[:-1])
    assert 0 < out2["completion_tokens"] < 900

    # structured outputs, in msgpack (a schema as a map) and JSON (OpenAI's response_format)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    rid3, rid4 = uuid.uuid4().hex, uuid.uuid4().hex
    body3 = {"id": rid3, "model": "gen", "inputs": ["it"], "max_new_tokens": 30,
             "structured_outputs": {"json": schema, "disable_any_whitespace": True}}  # fmt: skip
    r.xadd("bf:{gen}:lane:1", {"msgpack": msgpack.packb(body3)})
    body4 = {"id": rid4, "model": "gen", "inputs": ["it"], "max_new_tokens": 30,
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "flag", "schema": schema}}}  # fmt: skip
    r.xadd("bf:{gen}:lane:1", {"json": json.dumps(body4)})
    (out3,) = msgpack.unpackb(poll(r, f"bf:{{gen}}:result:{rid3}"))["outputs"]
    assert out3["finish_reason"] == "stop" and json.loads(out3["text"]) in ({"ok": True},
                                                                           {"ok": False})  # fmt: skip
    (out4,) = json.loads(poll(r, f"bf:{{gen}}:result:{rid4}"))["outputs"]
    assert out4["finish_reason"] in ("stop", "length")  # any whitespace allowed here
    if out4["finish_reason"] == "stop":
        assert set(json.loads(out4["text"])) == {"ok"}

    # tool calling, in JSON, streamed: the named function's arguments come back as a tool
    # call, in the token stream (and on the reply channel) as it completes, and in the result
    rid5 = uuid.uuid4().hex
    tools = [{"type": "function", "function": {"name": "flag", "parameters": schema}}]
    body5 = {"id": rid5, "model": "gen", "messages": [{"role": "user", "content": "it"}],
             "max_new_tokens": 30, "tools": tools, "stream": True, "reply": "svc-gen",
             "tool_choice": {"type": "function", "function": {"name": "flag"}}}  # fmt: skip
    r.xadd("bf:{gen}:lane:1", {"json": json.dumps(body5)})
    (out5,) = json.loads(poll(r, f"bf:{{gen}}:result:{rid5}"))["outputs"]
    (call,) = out5["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "flag"
    assert json.loads(call["function"]["arguments"]) in ({"ok": True}, {"ok": False})
    assert out5["content"] == ""
    entries5 = read_tokens(r, f"bf:{{gen}}:tokens:{rid5}")
    streamed = [json.loads(f[b"tool_calls"]) for f in entries5 if b"tool_calls" in f]
    assert streamed == [[call]]  # once, with the result's id
    # every delta carries its piece of the content (none here: the text is the call)
    assert all(b"content" in f for f in entries5[:-1])
    assert "".join(f[b"content"].decode() for f in entries5[:-1]) == out5["content"]
    # token ids in and out: a prompt as ids, streamed; the deltas' ids add up to the result's
    rid6 = uuid.uuid4().hex
    body6 = {"id": rid6, "model": "gen", "inputs": [{"prompt_token_ids": [5, 6, 7]}],
             "max_new_tokens": 6, "stream": True, "return_token_ids": True}  # fmt: skip
    r.xadd("bf:{gen}:lane:1", {"json": json.dumps(body6)})
    (out6,) = json.loads(poll(r, f"bf:{{gen}}:result:{rid6}"))["outputs"]
    assert out6["prompt_token_ids"] == [5, 6, 7] and out6["prompt_tokens"] == 3
    assert len(out6["token_ids"]) == out6["completion_tokens"] > 0
    entries6 = read_tokens(r, f"bf:{{gen}}:tokens:{rid6}")
    streamed6 = [t for f in entries6[:-1] for t in json.loads(f[b"token_ids"])]
    assert streamed6 == out6["token_ids"]
    while (message := pubsub.get_message(timeout=5)) is not None:
        sent = json.loads(message["data"])
        if sent.get("id") == rid5 and "tool_calls" in sent:
            assert sent["tool_calls"] == [call] and sent["content"] == ""
            break
    else:
        raise AssertionError("no delta message with the tool call")
    pubsub.close()


def test_plain_redis_client_sends_images(
    redis_url: str, r: redis.Redis, tiny_vit: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    import base64
    import io

    from PIL import Image

    fleet = fleet_toml(redis_url, {"pics": {"path": str(tiny_vit),
                                            "runner": "image-classification"}})  # fmt: skip
    start_worker(fleet, "raw-images").wait_ready(r, "pics")

    def png(width: int, height: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (width, height), (200, 30, 90)).save(buf, format="PNG")
        return buf.getvalue()

    # msgpack: the image as bin
    rid = uuid.uuid4().hex
    body = {"id": rid, "model": "pics", "inputs": [png(40, 30), png(7, 90)]}
    r.xadd("bf:{pics}:lane:1", {"msgpack": msgpack.packb(body, use_bin_type=True)})
    result = msgpack.unpackb(poll(r, f"bf:{{pics}}:result:{rid}"))
    assert result["status"] == "ok", result.get("error")
    assert [set(o) for o in result["outputs"]] == [{"label", "score", "scores"}] * 2

    # JSON: the image as {"image_b64": ...}; a corrupt one is invalid_input, alone
    rid2, rid3 = uuid.uuid4().hex, uuid.uuid4().hex
    b64 = base64.b64encode(png(64, 64)).decode()
    r.xadd("bf:{pics}:lane:1", {"json": json.dumps(
        {"id": rid2, "model": "pics", "inputs": [{"image_b64": b64}]})})  # fmt: skip
    r.xadd("bf:{pics}:lane:1", {"json": json.dumps(
        {"id": rid3, "model": "pics", "inputs": [{"image_b64": b64[:40]}]})})  # fmt: skip
    result2 = json.loads(poll(r, f"bf:{{pics}}:result:{rid2}"))
    assert result2["status"] == "ok" and result2["outputs"][0]["label"]
    result3 = json.loads(poll(r, f"bf:{{pics}}:result:{rid3}"))
    assert result3["status"] == "error" and result3["error"]["code"] == "invalid_input"

    # By reference: the bytes in bf:{pics}:input:<name>, written first with a TTL
    rid4 = uuid.uuid4().hex
    r.set("bf:{pics}:input:" + rid4, png(300, 120), ex=600)
    r.xadd("bf:{pics}:lane:1", {"json": json.dumps(
        {"id": rid4, "model": "pics", "inputs": [{"image_key": "bf:{pics}:input:" + rid4}]})})  # fmt: skip
    result4 = json.loads(poll(r, f"bf:{{pics}}:result:{rid4}"))
    assert result4["status"] == "ok", result4.get("error")
