"""Text generation through a real worker process: token streams, reply-channel deltas,
cancellation by key, deadlines mid-generation. The client side is bare redis-py."""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from conftest import WorkerProcess, fleet_toml, next_message
from tiny_models import make_causal_lm

pytestmark = pytest.mark.timeout(180)

MODEL = "tinylm"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A 4096-token context: a 4000-token generation outlasts a 1.5 s deadline even on a
    # machine several times faster than CI (900 tokens took under 1.5 s here).
    return make_causal_lm(tmp_path_factory.mktemp("lm"), context=4096)


@pytest.fixture
def worker(
    redis_url: str, r: redis.Redis, lm_dir: Path, start_worker: Callable[..., WorkerProcess]
) -> Iterator[WorkerProcess]:
    opts = {"kv_cache_tokens": 4096, "page_size": 16, "step_tokens": 64, "max_running": 16,
            "tool_call_parser": "hermes"}  # fmt: skip
    text = fleet_toml(redis_url, {MODEL: {"runner": "text-generation", "path": str(lm_dir),
                                          "options": opts}})  # fmt: skip
    w = start_worker(text, "gen-1")
    w.wait_ready(r, MODEL)
    yield w


def submit(r: redis.Redis, **fields: Any) -> str:
    rid = fields.setdefault("id", uuid.uuid4().hex)
    body = {"v": 1, "model": MODEL, **fields}
    r.xadd(f"bf:{{{MODEL}}}:lane:0", {"msgpack": msgpack.packb(body)})
    return str(rid)


def result(
    r: redis.Redis,
    rid: str,
    timeout: float = 60.0,
    decode: Callable[[bytes], Any] = msgpack.unpackb,
) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        raw = r.get(f"bf:{{{MODEL}}}:result:{rid}")
        if raw is not None:
            out: dict[str, Any] = decode(raw)
            return out
        time.sleep(0.05)
    raise TimeoutError(rid)


def token_stream(r: redis.Redis, rid: str, timeout: float = 60.0) -> list[dict[bytes, bytes]]:
    """Read a token stream from its start to its end entry."""
    key, last, got = f"bf:{{{MODEL}}}:tokens:{rid}", "0-0", []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for _, entries in r.xread({key: last}, block=1000) or []:
            for eid, fields in entries:
                last = eid
                got.append(fields)
                if fields.get(b"end") == b"1":
                    return got
    raise TimeoutError(rid)


def test_streamed_generation_by_token_stream_and_reply_channel(
    r: redis.Redis, worker: WorkerProcess
) -> None:
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("gen-replies")
    rid = submit(r, messages=[{"role": "user", "content": "what is this"}], max_new_tokens=12,
                 stream=True, reply="gen-replies")  # fmt: skip
    entries = token_stream(r, rid)
    res = result(r, rid)
    assert res["status"] == "ok"
    (out,) = res["outputs"]
    assert out["completion_tokens"] == 12 and out["finish_reason"] == "length"
    assert res["usage"] == {"prompt_tokens": out["prompt_tokens"], "completion_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": out["cached_tokens"]}}  # fmt: skip
    assert 0 < res["timings"]["first_token_ms"] <= res["timings"]["total_ms"]
    deltas, end = entries[:-1], entries[-1]
    assert [int(e[b"seq"]) for e in entries] == list(range(1, len(entries) + 1))
    assert end[b"end"] == b"1"
    assert "".join(e[b"text"].decode() for e in deltas) == out["text"]
    assert sum(int(e[b"tokens"]) for e in deltas) == 12
    # the reply channel: the same deltas as messages, then the result
    messages = []
    while (msg := next_message(pubsub, 5.0)) is not None:
        messages.append(msgpack.unpackb(msg["data"]))
        if "status" in messages[-1]:
            break
    pubsub.close()
    assert [m["text"] for m in messages[:-1]] == [e[b"text"].decode() for e in deltas]
    assert all(m["kind"] == "delta" and m["id"] == rid for m in messages[:-1])
    assert messages[-1]["id"] == rid and messages[-1]["status"] == "ok"
    assert r.ttl(f"bf:{{{MODEL}}}:tokens:{rid}") > 0


def test_tool_calls_stream_as_they_are_written(r: redis.Redis, worker: WorkerProcess) -> None:
    # Given a chat with tools whose text a regex makes a hermes call (a random model writes
    # none), streamed in JSON on a reply channel
    markup = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", '
              '"days": 3}}</tool_call>')  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("tool-replies")
    rid = submit(r, messages=[{"role": "user", "content": "weather?"}], tools=tools,
                 structured_outputs={"regex": re.escape(markup)}, max_new_tokens=200,
                 stream=True, reply="tool-replies", format="json")  # fmt: skip
    entries = token_stream(r, rid)[:-1]
    res = result(r, rid, decode=json.loads)  # stored in the request's encoding
    (out,) = res["outputs"]
    assert out["text"] == markup and out["content"] == "Sure."
    (call,) = out["tool_calls"]
    # Then the token stream's tool_call_chunks add up to the call, OpenAI's way
    pieces = [c for e in entries for c in json.loads(e.get(b"tool_call_chunks", b"[]"))]
    assert pieces[0] == {"index": 0, "id": call["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}  # fmt: skip
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    assert call["function"]["arguments"] == '{"city":"Zürich","days":3}' and len(pieces) > 5
    assert "".join(e[b"content"].decode() for e in entries) == "Sure."
    # and so do the reply channel's messages
    messages = []
    while (msg := next_message(pubsub, 5.0)) is not None:
        messages.append(json.loads(msg["data"]))
        if "status" in messages[-1]:
            break
    pubsub.close()
    sent = [c for m in messages[:-1] for c in m.get("tool_call_chunks", ())]
    assert sent == pieces


def test_cancel_by_key_and_deadline_mid_generation(r: redis.Redis, worker: WorkerProcess) -> None:
    long = submit(r, inputs=["the man was"], max_new_tokens=4000)
    late = submit(r, inputs=["a b c"], max_new_tokens=4000, deadline_ms=1500)
    plain = submit(r, inputs=["it"], max_new_tokens=5)
    assert result(r, plain)["outputs"][0]["completion_tokens"] == 5
    r.set(f"bf:{{{MODEL}}}:cancel:{long}", "1", ex=60)
    res = result(r, long)
    (out,) = res["outputs"]
    assert res["status"] == "ok" and out["finish_reason"] == "cancelled"
    assert 0 < out["completion_tokens"] < 4000
    res = result(r, late)
    assert res["status"] == "ok" and res["outputs"][0]["finish_reason"] == "deadline"
    assert 0 < res["outputs"][0]["completion_tokens"] < 4000


def test_bad_generation_requests_get_error_results(r: redis.Redis, worker: WorkerProcess) -> None:
    both = submit(r, inputs=["x"], messages=[{"role": "user", "content": "y"}])
    huge = submit(r, inputs=["x"], max_new_tokens=10**6)
    long_prompt = submit(r, inputs=[" ".join(["word"] * 3000)])
    assert result(r, both)["error"]["code"] == "invalid_request"
    assert result(r, huge)["error"]["code"] == "too_large"
    assert result(r, long_prompt)["error"]["code"] == "too_large"
    ok = submit(r, inputs=["it"], max_new_tokens=3)
    assert result(r, ok)["status"] == "ok"


def test_logits_rules_reach_the_engine(r: redis.Redis, worker: WorkerProcess, lm_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm_dir)
    model = AutoModelForCausalLM.from_pretrained(lm_dir, dtype="float32").eval()
    ids = tok("the man was", return_tensors="pt").input_ids

    def generate(**rules: Any) -> str:
        out = model.generate(ids, max_new_tokens=10, do_sample=False,
                             pad_token_id=tok.pad_token_id, **rules)  # fmt: skip
        return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

    rid = submit(r, inputs=["the man was"], max_new_tokens=10, repetition_penalty=3.0)
    assert result(r, rid)["outputs"][0]["text"] == generate(repetition_penalty=3.0) != generate()
    first = int(model.generate(ids, max_new_tokens=1, do_sample=False,
                               pad_token_id=tok.pad_token_id)[0, -1])  # fmt: skip
    banned = submit(r, inputs=["the man was"], max_new_tokens=10, logit_bias={str(first): -100})
    want = generate(sequence_bias={(first,): -100.0})
    assert result(r, banned)["outputs"][0]["text"] == want != generate()
    bad = submit(r, inputs=["x"], max_new_tokens=3, min_new_tokens=4)
    assert result(r, bad)["error"]["code"] == "invalid_request"
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("lp-replies")
    lp = submit(r, inputs=["the man was"], max_new_tokens=4, logprobs=2, stream=True,
                reply="lp-replies")  # fmt: skip
    entries = token_stream(r, lp)
    (out,) = result(r, lp)["outputs"]
    kept = out["logprobs"]
    assert "".join(e["text"] for e in kept) == out["text"] == generate()[: len(out["text"])]
    assert len(kept) == 4 and all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in kept)
    # the deltas carry them too: on the token stream (JSON text) and in the messages
    streamed = [e for f in entries[:-1] for e in json.loads(f[b"logprobs"])]
    assert streamed == kept
    messages = []
    while (msg := next_message(pubsub, 5.0)) is not None:
        messages.append(msgpack.unpackb(msg["data"]))
        if "status" in messages[-1]:
            break
    pubsub.close()
    assert [e for m in messages[:-1] for e in m["logprobs"]] == kept
    # a prompt's scores (vLLM's prompt_logprobs), and a prompt cut to its last 2 tokens
    scored = submit(r, inputs=["the man was"], max_new_tokens=1, prompt_logprobs=1)
    (out,) = result(r, scored)["outputs"]
    with torch.inference_mode():
        lps = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == ids.shape[1]
    got = [e["logprob"] for e in out["prompt_logprobs"][1:]]
    assert got == pytest.approx([float(lps[k, t]) for k, t in enumerate(ids[0, 1:])], abs=1e-4)
    cut = submit(r, inputs=["the man was"], max_new_tokens=10, truncate_prompt_tokens=2)
    (out,) = result(r, cut)["outputs"]
    tail = model.generate(ids[:, -2:], max_new_tokens=10, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, 2:]  # fmt: skip
    assert out["prompt_tokens"] == 2
    assert out["text"] == tok.decode(tail, skip_special_tokens=True)
    # structured outputs: a JSON schema's text (streamed), and a regex llguidance refuses
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 999}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    shaped = submit(r, inputs=["the man was"], max_new_tokens=30, stream=True,
                    structured_outputs={"json": schema, "disable_any_whitespace": True})  # fmt: skip
    entries = token_stream(r, shaped)
    (out,) = result(r, shaped)["outputs"]
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"n"}
    assert "".join(e[b"text"].decode() for e in entries[:-1]) == out["text"]
    refused = submit(r, inputs=["x"], structured_outputs={"regex": "(unclosed"})
    error = result(r, refused)["error"]
    assert error["code"] == "invalid_request" and "structured_outputs.regex" in error["message"]


def test_n_completions_per_input_through_a_worker(
    r: redis.Redis, worker: WorkerProcess, lm_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm_dir)
    prompts = ["the man was", "a b c"]
    rid = submit(r, inputs=prompts, n=3, max_new_tokens=5, temperature=1.3, seed=4)
    res = result(r, rid)
    assert res["status"] == "ok" and len(res["outputs"]) == 6
    assert all(o["completion_tokens"] == 5 for o in res["outputs"])
    # each prompt counts once in the usage, every completion's tokens do
    prompt_tokens = sum(len(tok(p).input_ids) for p in prompts)
    cached = sum(o["cached_tokens"] for o in res["outputs"][::3])
    assert res["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 30,
                            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    again = submit(r, inputs=prompts[1:], max_new_tokens=5, temperature=1.3, seed=6)
    assert result(r, again)["outputs"][0]["text"] == res["outputs"][5]["text"]  # seed + 2
    big = submit(r, inputs=["x"] * 22, n=3, max_new_tokens=2)  # 66 outputs > max_inputs
    assert result(r, big)["error"]["code"] == "too_large"


def test_status_shows_generation_state(
    redis_url: str, r: redis.Redis, worker: WorkerProcess
) -> None:
    from batchfleet.status import gather

    rid = submit(r, inputs=["it"], max_new_tokens=16, min_new_tokens=16)
    res = result(r, rid)
    assert res["status"] == "ok"
    # not streamed: its first token came with its first step, not with its result
    assert 0 < res["timings"]["first_token_ms"] < res["timings"]["total_ms"]
    rows = [w for w in gather(redis_url, [MODEL]).worker_rows() if w["model"] == MODEL]
    assert rows and rows[0]["running"] == 0 and rows[0]["kv_cache_usage"] == 0
    assert rows[0]["tokens_per_s"] > 0  # tokens generated in the last minute


def test_a_request_cancelled_before_it_is_read_never_starts(
    r: redis.Redis, worker: WorkerProcess
) -> None:
    rid = uuid.uuid4().hex
    r.set(f"bf:{{{MODEL}}}:cancel:{rid}", "1", ex=60)
    submit(r, id=rid, inputs=["the man was"], max_new_tokens=50, stream=True,
           return_token_ids=True)  # fmt: skip
    res = result(r, rid)
    assert res["status"] == "ok" and res["outputs"][0]["finish_reason"] == "cancelled"
    assert res["outputs"][0]["completion_tokens"] == 0
    assert res["outputs"][0]["token_ids"] == []  # asked for: none generated (vLLM's abort)
    assert token_stream(r, rid) == [{b"life": b"1", b"seq": b"1", b"end": b"1"}]


def test_budgets_change_live_by_remote_control(
    redis_url: str, r: redis.Redis, worker: WorkerProcess
) -> None:
    import socket

    from celery import Celery

    from batchfleet import cli

    # a loaded CI machine: a 10 s wait for the reply was missed once
    dest = ["-d", f"gen-1@{socket.gethostname()}", "--timeout", "30"]
    assert cli.main(["policy", MODEL, "max_running=4", "step_tokens=32",
                     "--redis-url", redis_url, *dest]) == 0  # fmt: skip
    # above the fleet file's, or not a knob of a generating model: refused, nothing changes
    assert cli.main(["policy", MODEL, "max_running=17", "--redis-url", redis_url, *dest]) == 1
    assert cli.main(["policy", MODEL, "max_wait_ms=2", "--redis-url", redis_url, *dest]) == 1
    rids = [submit(r, inputs=["it"], max_new_tokens=6) for _ in range(6)]
    assert all(result(r, rid)["status"] == "ok" for rid in rids)
    app = Celery("t", broker=redis_url, set_as_current=False)
    try:
        state = app.control.inspect(timeout=5, destination=[dest[1]])._request("bf_state") or {}
    finally:
        app.close()
    policy = state[dest[1]][MODEL]["policy"]
    assert (policy["max_running"], policy["step_tokens"], policy["kv_cache_tokens"]) == (
        4,
        32,
        4096,
    )


def test_lane0_streams_arriving_at_any_moment_all_end(
    r: redis.Redis, worker: WorkerProcess
) -> None:
    # lane-0 arrivals replan the step queued behind the running one (planned ahead): at
    # random moments, some while the device thread has not yet taken its next step
    rng = random.Random(7)
    rids: list[str] = []
    for _ in range(40):
        rids.append(submit(r, messages=[{"role": "user", "content": "what is this " * rng.randint(1, 20)}],
                           max_new_tokens=rng.randint(1, 30), stream=True))  # fmt: skip
        time.sleep(rng.uniform(0, 0.03))
    for rid in rids:
        assert result(r, rid)["status"] == "ok"
        stream = token_stream(r, rid, timeout=5)
        assert stream[-1] == {b"life": b"1", b"seq": str(len(stream)).encode(), b"end": b"1"}
    assert b"crashed" not in worker.log.read_bytes()
