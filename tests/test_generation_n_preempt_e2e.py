"""Requests of ``n > 1`` under KV memory pressure through a real worker process and a real
Redis: the admission policy preempts their completions a sequence at a time (vLLM's child
requests, ``batching/gen_victims.py``), they resume by recomputation, and every request
ends once with its ``n`` greedy outputs, each the tokens of a one-at-a-time greedy
generation. ``batchfleet_preemptions`` counts sequences, not requests. A request whose
completions can never fit the cache together is refused (``invalid_request``). One worker
for all of it: a worker's start took most of a minute or more on a loaded 2-core machine."""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from conftest import WorkerProcess, fleet_toml, next_message
from tiny_models import make_causal_lm

from batchfleet.redis_server import free_port

pytestmark = pytest.mark.timeout(540)

torch = pytest.importorskip("torch")

MODEL = "tinylm"
PAGE = 16
REPLY = "n-preempt-replies"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("lm"))


def submit(r: redis.Redis, text: str, n: int, tokens: int) -> str:
    rid = uuid.uuid4().hex
    body = {"v": 1, "model": MODEL, "id": rid, "inputs": [text], "n": n, "max_new_tokens": tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": True,
            "reply": REPLY}  # fmt: skip
    r.xadd(f"bf:{{{MODEL}}}:lane:0", {"msgpack": msgpack.packb(body)})
    return rid


def replies(pubsub: redis.client.PubSub, rids: list[str], timeout: float) -> dict[str, list[Any]]:
    """Every reply-channel message per request, until each has had its result (and a
    moment more, to see a second result if one came)."""
    got: dict[str, list[Any]] = {rid: [] for rid in rids}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        msg = next_message(pubsub, 1.0)
        if msg is not None:
            body = msgpack.unpackb(msg["data"])
            got[body["id"]].append(body)
        elif all(any("status" in m for m in ms) for ms in got.values()):
            return got
    raise TimeoutError({k for k, ms in got.items() if not any("status" in m for m in ms)})


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith(f'{name}{{model="{MODEL}"}}')]
    return float(line.rsplit(" ", 1)[1])


def greedy(lm_dir: Path, text: str, tokens: int) -> list[int]:
    """``text``'s greedy continuation, one sequence alone, the whole context each token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm_dir)
    model = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()
    ids = tok(text, return_tensors="pt").input_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def prompt_tokens(lm_dir: Path, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(lm_dir)(text).input_ids)


def run(
    r: redis.Redis, requests: list[tuple[str, int, int]], timeout: float = 180.0
) -> dict[str, list[Any]]:
    """Submit ``(text, n, max_new_tokens)`` requests; every reply message of each, by id."""
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(REPLY)
    try:
        return replies(pubsub, [submit(r, *req) for req in requests], timeout)
    finally:
        pubsub.close()


def check_ended_once(
    r: redis.Redis, lm_dir: Path, rid: str, messages: list[Any], text: str, n: int, tokens: int
) -> None:
    """One result, last, ok, with ``n`` outputs of ``tokens`` greedy tokens each; a token
    stream of contiguous deltas and one end."""
    results = [m for m in messages if "status" in m]
    assert len(results) == 1 and messages[-1] is results[0], f"{rid} ended {len(results)} times"
    res = results[0]
    assert res["status"] == "ok", res
    expected = greedy(lm_dir, text, tokens)
    assert [o["token_ids"] for o in res["outputs"]] == [expected] * n
    assert [o["completion_tokens"] for o in res["outputs"]] == [tokens] * n
    entries = r.xrange(f"bf:{{{MODEL}}}:tokens:{rid}")
    ends = [f for _, f in entries if f.get(b"end") == b"1"]
    assert len(ends) == 1 and entries[-1][1] is ends[0]
    assert [int(f[b"seq"]) for _, f in entries] == list(range(1, len(entries) + 1))


def start(
    redis_url: str,
    r: redis.Redis,
    lm_dir: Path,
    start_worker: Callable[..., WorkerProcess],
    name: str,
    kv_blocks: int,
    **extra: Any,
) -> tuple[WorkerProcess, int]:
    port = free_port()
    opts = {"kv_cache_tokens": kv_blocks * PAGE, "page_size": PAGE, "step_tokens": 64,
            "max_running": 8, "prefix_cache_tokens": 0, "schedule_ahead": False, **extra}  # fmt: skip
    text = fleet_toml(redis_url, {MODEL: {"runner": "text-generation", "path": str(lm_dir),
                                          "options": opts}})  # fmt: skip
    text += f'\n[metrics]\nport = {port}\naddress = "127.0.0.1"\n'
    w = start_worker(text, name)
    w.wait_ready(r, MODEL, timeout=300)  # (a loaded 2-core machine took over 120 s)
    return w, port


def test_completions_preempted_a_sequence_at_a_time_end_once_those_never_fitting_refused(
    redis_url: str, r: redis.Redis, lm_dir: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    # Given a worker whose KV cache holds 3 blocks of 16 tokens, and a request of three
    # greedy completions that each outgrow one block but fit in two (planned in turn, so
    # each step's plan sees the last step's state)
    text = "the man was"
    p = prompt_tokens(lm_dir, text)
    tokens = 2 * PAGE - 2 - p  # its context never needs a third block
    assert p + 1 < PAGE
    w, port = start(redis_url, r, lm_dir, start_worker, "gen-n", 3)

    # When it runs: its three sequences cross into a second block in the same step (6
    # blocks of 3), and the policy frees its last two completions alone (the first runs
    # on), which resume one at a time as memory frees
    ((rid, messages),) = run(r, [(text, 3, tokens)]).items()

    # Then it ends once with three greedy outputs, and two preemptions are counted: one
    # per sequence (the runner's one event freed two)
    check_ended_once(r, lm_dir, rid, messages, text, 3, tokens)
    assert scrape(port, "batchfleet_preemptions_total") == 2

    # And when several such requests come at once, of two or three completions (a new
    # request starts with all of them: their prompts fit the cache together), each
    # fitting in two blocks alone, everyone ends once with its greedy outputs
    load = [("the man was", 2, 24), ("a b c", 3, 20), ("it was the time", 3, 18),
            ("we can do", 2, 26), ("the man was", 3, 12)]  # fmt: skip
    got = run(r, load)
    for (rid, messages), (text_, n, k) in zip(got.items(), load, strict=True):
        check_ended_once(r, lm_dir, rid, messages, text_, n, k)
    assert scrape(port, "batchfleet_preemptions_total") > 2

    # And a request of four completions, a block each (each alone would fit), can never
    # start: it is answered once, invalid_request saying why (not expired), its token
    # stream ended without a delta; one of two completions behind it runs as usual
    got = run(r, [(text, 4, 8), (text, 2, 8)])
    (wide, wide_messages), (ok, ok_messages) = got.items()
    (result,) = [m for m in wide_messages if "status" in m]
    assert result["status"] == "error" and result["error"]["code"] == "invalid_request"
    assert "4 sequences together need 4 KV cache blocks" in result["error"]["message"]
    assert "over the 3 of 3" in result["error"]["message"]
    entries = r.xrange(f"bf:{{{MODEL}}}:tokens:{wide}")
    assert [f.get(b"end") for _, f in entries] == [b"1"]
    check_ended_once(r, lm_dir, ok, ok_messages, text, 2, 8)
    assert b"crashed" not in w.log.read_bytes()
