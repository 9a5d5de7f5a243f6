"""Generation from docs/protocol.md alone: a client that knows nothing of batchfleet's code.

Its client side uses bare redis-py, msgpack and json, as a service in another language
would: keys, request fields, the token stream, reply-channel deltas, cancel keys, results
and error codes exactly as the doc names them. Only the fixtures (one worker process for
the module, serving the tiny Llama) come from the test suite. Each test is one check of
one promise of the doc, so a run reads as "N of M checks passed".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml
from tiny_models import make_causal_lm

from batchfleet.redis_server import LocalRedis

M = "blindgen"
CONTEXT = 4096
PROMPT = "the man was"
WAIT_S = 90.0


# --- the client: nothing but redis-py, msgpack and json ------------------------------------


def key(suffix: str) -> str:
    return f"bf:{{{M}}}:{suffix}"


def submit(r: redis.Redis, lane: int = 0, encoding: str = "msgpack", **fields: Any) -> str:
    """XADD one request map to a lane; the id is chosen here (a UUID, as the doc suggests)."""
    rid = str(fields.setdefault("id", uuid.uuid4().hex))
    body = {"model": M, **fields}
    raw = msgpack.packb(body) if encoding == "msgpack" else json.dumps(body).encode()
    r.xadd(key(f"lane:{lane}"), {encoding: raw})
    return rid


def decode(raw: bytes) -> Any:
    """A result or delta in either encoding (JSON starts with `{`, msgpack maps do not)."""
    return json.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw)


def result(r: redis.Redis, rid: str, timeout: float = WAIT_S) -> dict[str, Any]:
    """Poll `GET bf:{model}:result:<id>` with a short backoff until it exists."""
    end, pause = time.monotonic() + timeout, 0.001
    while time.monotonic() < end:
        raw: Any = r.get(key(f"result:{rid}"))
        if raw is not None:
            out: dict[str, Any] = decode(raw)
            return out
        time.sleep(pause)
        pause = min(pause * 2, 0.025)
    raise TimeoutError(f"no result for {rid}")


def ask(r: redis.Redis, **fields: Any) -> dict[str, Any]:
    return result(r, submit(r, **fields))


def error_code(r: redis.Redis, **fields: Any) -> str:
    res = ask(r, **fields)
    assert res["status"] == "error", res
    return str(res["error"]["code"])


def read_tokens(r: redis.Redis, rid: str, after: str = "0-0") -> list[tuple[str, dict[str, str]]]:
    """Every token-stream entry after ``after`` up to the `end` entry, as the doc says to
    read it: XREAD BLOCK a second at a time; after an empty read, stop where the result
    exists and nothing more comes."""
    entries: list[tuple[str, dict[str, str]]] = []
    last, end = after, time.monotonic() + WAIT_S
    while time.monotonic() < end:
        got: Any = r.xread({key(f"tokens:{rid}"): last}, block=1000)
        if not got:
            if r.exists(key(f"result:{rid}")) and not r.xread(
                {key(f"tokens:{rid}"): last}, block=250
            ):
                return entries
            continue
        for eid, fields in got[0][1]:
            last = eid.decode()
            entry = {k.decode(): v.decode() for k, v in fields.items()}
            entries.append((last, entry))
            if "end" in entry:
                return entries
    raise TimeoutError(f"token stream of {rid} never ended")


def deltas_text(entries: list[tuple[str, dict[str, str]]], output: int = 0) -> str:
    return "".join(e["text"] for _, e in entries if "end" not in e and int(e["input"]) == output)


# --- the fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_causal_lm(tmp_path_factory.mktemp("blind-lm"), context=CONTEXT)


def _config(url: str, lm_dir: Path) -> str:
    opts = {**TINY_LM_OPTIONS, "kv_cache_tokens": 2 * CONTEXT}
    # max_tokens: the longest prompt (docs/protocol.md: default 512, at most the context - 1)
    spec = {"runner": "text-generation", "path": str(lm_dir), "max_tokens": CONTEXT - 1,
            "options": opts}  # fmt: skip
    return fleet_toml(url, {M: spec}, {"heartbeat_timeout_ms": 3000})


@pytest.fixture(scope="module")
def fleet(
    redis_server: LocalRedis, lm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[redis.Redis, WorkerProcess, Path]]:
    """One worker for the whole module (a fresh database first)."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    tmp = tmp_path_factory.mktemp("blind-fleet")
    config = tmp / "fleet.toml"
    config.write_text(_config(redis_server.url, lm_dir))
    worker = WorkerProcess(config, "blind-1", tmp / "blind-1.log")
    try:
        worker.wait_ready(client, M)
        yield client, worker, tmp
    finally:
        worker.stop()
        client.close()


@pytest.fixture
def r(fleet: tuple[redis.Redis, WorkerProcess, Path]) -> redis.Redis:
    return fleet[0]


def greedy_long(r: redis.Redis, n_tokens: int = 24) -> dict[str, Any]:
    """A greedy text of exactly ``n_tokens`` tokens (end of sequence ignored), with its ids."""
    res = ask(r, inputs=[PROMPT], max_new_tokens=n_tokens, ignore_eos=True, return_token_ids=True)
    assert res["status"] == "ok", res
    return dict(res["outputs"][0])


# --- registry and capabilities --------------------------------------------------------------


def test_registry_names_the_model_its_lanes_and_its_workers(r: redis.Redis) -> None:
    assert M.encode() in r.smembers("bf:models")
    lanes = r.get(key("lanes"))
    assert lanes is None or int(lanes) >= 1
    assert r.hexists(key("workers"), "blind-1")
    limits = json.loads(r.get(key("limits")) or b"{}")
    assert isinstance(limits.get("max_inputs"), int)


def test_model_info_describes_a_generating_model(r: redis.Redis) -> None:
    info = json.loads(r.get(key("info")) or b"{}")
    assert info["task"] == "text-generation"
    assert info["max_model_len"] == CONTEXT
    assert info["max_new_tokens"] == 4096  # limits.max_new_tokens' default
    assert info["default_max_new_tokens"] == 256  # the model option's default
    assert info["chat_template"] is True
    assert info["max_prompt_tokens"] == CONTEXT - 1  # max_tokens, at most the context - 1


# --- submitting: inputs, messages, encodings ------------------------------------------------


def test_inputs_give_one_output_per_input_with_its_fields(r: redis.Redis) -> None:
    res = ask(r, inputs=[PROMPT, "there were many"], max_new_tokens=5, metadata={"k": "v"})
    assert res["v"] == 1 and res["model"] == M and res["status"] == "ok"
    assert res["metadata"] == {"k": "v"} and isinstance(res["finished_at_ms"], int)
    assert len(res["outputs"]) == 2
    for out in res["outputs"]:
        assert isinstance(out["text"], str)
        assert out["finish_reason"] in ("stop", "length")
        assert 1 <= out["completion_tokens"] <= 5
        assert out["prompt_tokens"] >= 1
    usage = res["usage"]
    assert usage["prompt_tokens"] == sum(o["prompt_tokens"] for o in res["outputs"])
    assert usage["completion_tokens"] == sum(o["completion_tokens"] for o in res["outputs"])
    assert "cached_tokens" in usage["prompt_tokens_details"]
    assert "truncated" not in res  # "not sent by generation models"


def test_messages_give_one_output_from_the_rendered_chat(r: redis.Redis) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    res = ask(r, messages=chat, max_new_tokens=4, return_prompt_text=True)
    assert res["status"] == "ok" and len(res["outputs"]) == 1
    out = res["outputs"][0]
    assert PROMPT in out["prompt_text"] and "be brief" in out["prompt_text"]
    plain = ask(r, inputs=[PROMPT], max_new_tokens=1)["outputs"][0]
    assert out["prompt_tokens"] > plain["prompt_tokens"]  # the template's tokens count


def test_json_request_gets_a_json_result(r: redis.Redis) -> None:
    rid = submit(r, encoding="json", inputs=[PROMPT], max_new_tokens=3)
    result(r, rid)
    raw = r.get(key(f"result:{rid}"))
    assert raw is not None and json.loads(raw)["status"] == "ok"


def test_format_picks_the_result_encoding(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=3, format="json")
    result(r, rid)
    raw = r.get(key(f"result:{rid}"))
    assert raw is not None and json.loads(raw)["id"] == rid


def test_both_inputs_and_messages_is_invalid(r: redis.Redis) -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert error_code(r, inputs=[PROMPT], messages=chat) == "invalid_request"


def test_prompt_token_ids_are_taken_as_they_are(r: redis.Redis) -> None:
    out = greedy_long(r, 6)
    ids = ask(r, inputs=[PROMPT], max_new_tokens=1, return_token_ids=True)["outputs"][0]
    res = ask(r, inputs=[{"prompt_token_ids": ids["prompt_token_ids"]}], max_new_tokens=6,
              ignore_eos=True, return_token_ids=True)  # fmt: skip
    assert res["outputs"][0]["token_ids"] == out["token_ids"]
    assert res["outputs"][0]["prompt_token_ids"] == ids["prompt_token_ids"]


# --- sampling fields ------------------------------------------------------------------------


def test_greedy_is_the_default_and_repeats(r: redis.Redis) -> None:
    a, b = greedy_long(r), greedy_long(r)
    zero = ask(r, inputs=[PROMPT], max_new_tokens=24, ignore_eos=True, temperature=0,
               return_token_ids=True)["outputs"][0]  # fmt: skip
    assert a["token_ids"] == b["token_ids"] == zero["token_ids"]


def test_seed_repeats_a_sampled_text(r: redis.Redis) -> None:
    fields = {"inputs": [PROMPT], "max_new_tokens": 24, "ignore_eos": True,
              "temperature": 1.5, "seed": 7, "return_token_ids": True}  # fmt: skip
    a, b = ask(r, **fields), ask(r, **fields)
    assert a["outputs"][0]["token_ids"] == b["outputs"][0]["token_ids"]
    other = ask(r, **{**fields, "seed": 8})
    assert other["outputs"][0]["token_ids"] != a["outputs"][0]["token_ids"]


def test_top_k_one_is_greedy(r: redis.Redis) -> None:
    res = ask(r, inputs=[PROMPT], max_new_tokens=24, ignore_eos=True, temperature=1.0,
              top_k=1, seed=3, return_token_ids=True)  # fmt: skip
    assert res["outputs"][0]["token_ids"] == greedy_long(r)["token_ids"]


def test_every_sampling_field_is_accepted(r: redis.Redis) -> None:
    res = ask(r, inputs=[PROMPT], max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=20,
              min_p=0.01, seed=1, repetition_penalty=1.2, presence_penalty=0.5,
              frequency_penalty=0.5, min_new_tokens=2, skip_special_tokens=False,
              bad_words=["man"], cache_salt="tenant-a-secret")  # fmt: skip
    assert res["status"] == "ok", res
    assert res["outputs"][0]["completion_tokens"] >= 2


def test_n_gives_n_outputs_and_completion_zero_is_n_one(r: redis.Redis) -> None:
    fields = {"inputs": [PROMPT, "there were"], "max_new_tokens": 6, "ignore_eos": True,
              "temperature": 1.0, "seed": 11, "return_token_ids": True}  # fmt: skip
    two = ask(r, n=2, **fields)
    one = ask(r, **fields)
    assert len(two["outputs"]) == 4
    assert two["outputs"][0]["token_ids"] == one["outputs"][0]["token_ids"]
    assert two["outputs"][2]["token_ids"] == one["outputs"][1]["token_ids"]
    # a prompt counts once in usage, every completion's tokens count
    assert two["usage"]["completion_tokens"] == 4 * 6
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]


def test_logit_bias_forces_a_token(r: redis.Redis) -> None:
    target = greedy_long(r, 4)["token_ids"][0] + 1
    res = ask(r, inputs=[PROMPT], max_new_tokens=5, ignore_eos=True, return_token_ids=True,
              logit_bias={str(target): 100})  # fmt: skip
    assert res["outputs"][0]["token_ids"] == [target] * 5


def test_allowed_token_ids_limit_the_draw(r: redis.Redis) -> None:
    allowed = [40, 41, 42]
    res = ask(r, inputs=[PROMPT], max_new_tokens=8, temperature=1.0, seed=2,
              return_token_ids=True, allowed_token_ids=allowed)  # fmt: skip
    out = res["outputs"][0]
    assert set(out["token_ids"]) <= set(allowed) and out["completion_tokens"] == 8
    assert out["finish_reason"] == "length"  # no end-of-sequence token listed


def test_logprobs_one_per_token_with_alternatives(r: redis.Redis) -> None:
    out = ask(r, inputs=[PROMPT], max_new_tokens=5, ignore_eos=True, logprobs=2,
              return_token_ids=True)["outputs"][0]  # fmt: skip
    assert len(out["logprobs"]) == out["completion_tokens"] == 5
    for lp, tok in zip(out["logprobs"], out["token_ids"], strict=True):
        assert lp["token"] == tok and lp["logprob"] <= 0 and len(lp["top"]) == 2
        assert isinstance(lp["text"], str) and lp["rank"] >= 1


def test_prompt_logprobs_score_the_prompt(r: redis.Redis) -> None:
    out = ask(r, inputs=[PROMPT], max_new_tokens=0, prompt_logprobs=1)["outputs"][0]
    assert len(out["prompt_logprobs"]) == out["prompt_tokens"]
    assert out["prompt_logprobs"][0] is None
    assert all(p["logprob"] <= 0 for p in out["prompt_logprobs"][1:])


def test_truncate_prompt_tokens_keeps_the_last_tokens(r: redis.Redis) -> None:
    res = ask(r, inputs=["the man was there were many years of time and"], max_new_tokens=2,
              truncate_prompt_tokens=3)  # fmt: skip
    assert res["outputs"][0]["prompt_tokens"] == 3 == res["usage"]["prompt_tokens"]


def test_return_token_strs_lists_the_prompt_tokens(r: redis.Redis) -> None:
    out = ask(r, inputs=[PROMPT], max_new_tokens=1, return_token_strs=True)["outputs"][0]
    assert len(out["prompt_token_strs"]) == out["prompt_tokens"]


# --- chats, constraints, tools, beams, adapters ---------------------------------------------

CHAT = [{"role": "user", "content": PROMPT}]


def test_add_generation_prompt_false_leaves_the_turn_unopened(r: redis.Redis) -> None:
    opened = ask(r, messages=CHAT, max_new_tokens=1, return_prompt_text=True)["outputs"][0]
    closed = ask(r, messages=CHAT, max_new_tokens=1, return_prompt_text=True,
                 add_generation_prompt=False)["outputs"][0]  # fmt: skip
    assert opened["prompt_text"].startswith(closed["prompt_text"])
    assert closed["prompt_tokens"] < opened["prompt_tokens"]


def test_continue_final_message_goes_on_from_the_assistants_text(r: redis.Redis) -> None:
    chat = [*CHAT, {"role": "assistant", "content": "there were"}]
    out = ask(r, messages=chat, max_new_tokens=1, return_prompt_text=True,
              add_generation_prompt=False, continue_final_message=True)["outputs"][0]  # fmt: skip
    assert out["prompt_text"].endswith("there were")
    refused = ask(r, messages=chat, max_new_tokens=1, continue_final_message=True,
                  add_generation_prompt=True)  # fmt: skip
    assert refused["status"] == "error" and refused["error"]["code"] == "invalid_request"


def test_content_parts_are_a_text(r: redis.Redis) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    a = ask(r, messages=parts, max_new_tokens=4, ignore_eos=True, return_token_ids=True)
    b = ask(r, messages=CHAT, max_new_tokens=4, ignore_eos=True, return_token_ids=True)
    assert a["outputs"][0]["prompt_token_ids"] == b["outputs"][0]["prompt_token_ids"]


@pytest.mark.parametrize(
    ("constraint", "accepts"),
    [
        ({"choice": ["yes", "no way"]}, lambda t: t in ("yes", "no way")),
        ({"regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
    ],
    ids=["choice", "regex"],
)
def test_structured_outputs_hold_the_text(r: redis.Redis, constraint: Any, accepts: Any) -> None:
    out = ask(r, inputs=[PROMPT], max_new_tokens=16, structured_outputs=constraint)["outputs"][0]
    assert accepts(out["text"]) and out["finish_reason"] == "stop", out


def test_json_schema_is_followed(r: redis.Redis) -> None:
    # compact JSON: with any whitespace allowed, a small model may fill it to
    # max_new_tokens (the doc says so; the tiny Llama does)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    constraint = {"json": schema, "disable_any_whitespace": True}
    out = ask(r, messages=CHAT, max_new_tokens=64, structured_outputs=constraint)["outputs"][0]
    assert out["finish_reason"] == "stop", out
    assert isinstance(json.loads(out["text"])["ok"], bool)


def test_response_format_json_schema_constrains_the_text(r: redis.Redis) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}}
    out = ask(r, messages=CHAT, max_new_tokens=8, response_format=fmt)["outputs"][0]
    assert out["text"].startswith("{"), out
    both = ask(r, messages=CHAT, response_format=fmt, structured_outputs={"json": schema})
    assert both["error"]["code"] == "invalid_request"


def test_a_bad_constraint_is_invalid_request(r: redis.Redis) -> None:
    assert error_code(r, inputs=[PROMPT], structured_outputs={"regex": "(("}) == ("invalid_request")


def test_named_tool_choice_gives_a_call(r: redis.Redis) -> None:
    params = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
              "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params}}]
    choice = {"type": "function", "function": {"name": "weather"}}
    out = ask(r, messages=CHAT, max_new_tokens=64, tools=tools, tool_choice=choice)["outputs"][0]
    (call,) = out["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"])["unit"] in ("c", "f")


def test_tools_on_inputs_or_auto_without_a_parser_are_invalid(r: redis.Redis) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert error_code(r, inputs=[PROMPT], tools=tools, tool_choice="required") == (
        "invalid_request"
    )
    assert error_code(r, messages=CHAT, tools=tools) == "invalid_request"  # "auto", no parser


def test_beam_search_gives_the_n_best_beams(r: redis.Redis) -> None:
    res = ask(r, inputs=[PROMPT], max_new_tokens=6, use_beam_search=True, n=2)
    assert res["status"] == "ok" and len(res["outputs"]) == 2
    assert error_code(r, inputs=[PROMPT], use_beam_search=True, stream=True) == "invalid_request"


@pytest.mark.parametrize(
    "fields",
    [
        {"lora": "no-such-adapter"},
        {"thinking_token_budget": 10},  # the model has no reasoning markers
        {"chat_template": "{{ messages }}"},  # the model does not trust request templates
    ],
    ids=["lora", "thinking_token_budget", "chat_template"],
)
def test_what_the_model_info_says_it_lacks_is_invalid(
    r: redis.Redis, fields: dict[str, Any]
) -> None:
    assert error_code(r, messages=CHAT, max_new_tokens=2, **fields) == "invalid_request"


def test_repeated_prompt_reports_cached_tokens(r: redis.Redis) -> None:
    prompt = " ".join(["the man was there"] * 20) + f" {uuid.uuid4().hex[:6]}"
    ask(r, inputs=[prompt], max_new_tokens=1)
    again = ask(r, inputs=[prompt], max_new_tokens=1)
    cached = again["outputs"][0]["cached_tokens"]
    assert 0 < cached < again["outputs"][0]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


# --- stop, stop_token_ids, lengths ----------------------------------------------------------


def _stop_word(text: str) -> str:
    """A stop string from inside a greedy text: a piece after its first few characters."""
    word = text[4:8]
    assert word.strip(), text
    return word


def test_stop_string_cuts_the_text_before_it(r: redis.Redis) -> None:
    full = greedy_long(r, 30)["text"]
    word = _stop_word(full)
    out = ask(r, inputs=[PROMPT], max_new_tokens=30, ignore_eos=True, stop=[word])["outputs"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == word
    assert out["text"] == full[: full.index(word)]


def test_include_stop_str_in_output_keeps_it(r: redis.Redis) -> None:
    full = greedy_long(r, 30)["text"]
    word = _stop_word(full)
    out = ask(r, inputs=[PROMPT], max_new_tokens=30, ignore_eos=True, stop=[word],
              include_stop_str_in_output=True)["outputs"][0]  # fmt: skip
    assert out["text"] == full[: full.index(word) + len(word)]


def test_stop_token_ids_end_on_that_token(r: redis.Redis) -> None:
    ids = greedy_long(r, 10)["token_ids"]
    stop_id = ids[3]
    out = ask(r, inputs=[PROMPT], max_new_tokens=10, ignore_eos=True, return_token_ids=True,
              stop_token_ids=[stop_id])["outputs"][0]  # fmt: skip
    first = ids.index(stop_id)
    assert out["token_ids"] == ids[: first + 1]  # the token stays in the output
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop_id


def test_ignore_eos_runs_to_max_new_tokens(r: redis.Redis) -> None:
    out = ask(r, inputs=[PROMPT], max_new_tokens=40, ignore_eos=True)["outputs"][0]
    assert out["completion_tokens"] == 40 and out["finish_reason"] == "length"


def test_min_new_tokens_hold_off_the_end(r: redis.Redis) -> None:
    out = ask(r, inputs=[PROMPT], max_new_tokens=12, min_new_tokens=12)["outputs"][0]
    assert out["completion_tokens"] == 12 and out["finish_reason"] == "length"


def test_default_max_new_tokens_is_the_models(r: redis.Redis) -> None:
    info = json.loads(r.get(key("info")) or b"{}")
    out = ask(r, inputs=[PROMPT], ignore_eos=True)["outputs"][0]
    assert out["completion_tokens"] == info["default_max_new_tokens"]


def test_max_new_tokens_is_cut_to_what_the_context_leaves(r: redis.Redis) -> None:
    prompt = [5] * (CONTEXT - 20)
    out = ask(r, inputs=[{"prompt_token_ids": prompt}], max_new_tokens=100,
              ignore_eos=True)["outputs"][0]  # fmt: skip
    assert out["finish_reason"] == "length"
    assert out["completion_tokens"] == 20


def test_max_new_tokens_zero_answers_the_prompt_alone(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=0, stream=True, return_token_ids=True)
    res = result(r, rid)
    out = res["outputs"][0]
    assert out["text"] == "" and out["finish_reason"] == "length"
    assert out["completion_tokens"] == 0 and len(out["prompt_token_ids"]) == out["prompt_tokens"]
    ((_, only),) = read_tokens(r, rid)  # no delta: the end entry alone, seq 1
    assert only["seq"] == "1" and only["end"] == "1"


@pytest.mark.parametrize("value", [-1, "5", 5.0, True])
def test_max_new_tokens_out_of_range_or_type_is_refused(r: redis.Redis, value: Any) -> None:
    assert error_code(r, inputs=[PROMPT], max_new_tokens=value) == "invalid_request"


@pytest.mark.parametrize("fields", [{"max_new_tokens": 4097}, {"stop": ["a"] * 9}],
                         ids=["max_new_tokens", "stop"])  # fmt: skip
def test_over_the_models_limits_is_too_large(r: redis.Redis, fields: dict[str, Any]) -> None:
    assert error_code(r, inputs=[PROMPT], **fields) == "too_large"


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": "0.5"},
        {"temperature": 101},
        {"top_p": 0},
        {"top_k": -1},
        {"seed": 1.0},
        {"stop": "word"},
        {"stream": "yes"},
        {"logprobs": 21},
        {"n": 17},
        {"deadline_ms": "60000"},
        {"deadline_ms": 0},
        {"logit_bias": {"999999": 1}},
        {"unknown_field": 1},
        {"v": 2},
    ],
    ids=lambda f: next(iter(f)) + "=" + json.dumps(next(iter(f.values())))[:12],
)
def test_bad_fields_are_invalid_request(r: redis.Redis, fields: dict[str, Any]) -> None:
    assert error_code(r, inputs=[PROMPT], max_new_tokens=2, **fields) == "invalid_request"


def test_bad_field_result_is_a_never_computed_error(r: redis.Redis) -> None:
    res = ask(r, inputs=[PROMPT], temperature="hot")
    assert res["error"]["message"] and len(res["error"]["message"]) <= 1000
    t = res["timings"]
    assert t["batch_size"] == 0 and t["batch_id"] == "" and t["inference_ms"] == 0


def test_an_image_to_a_text_model_is_invalid_input(r: redis.Redis) -> None:
    assert error_code(r, inputs=[{"image_b64": "aGVsbG8="}], max_new_tokens=2) == "invalid_input"


def test_blank_input_is_empty_input(r: redis.Redis) -> None:
    assert error_code(r, inputs=["   "], max_new_tokens=2) == "empty_input"


def test_token_id_outside_the_vocabulary_is_invalid_input(r: redis.Redis) -> None:
    assert error_code(r, inputs=[{"prompt_token_ids": [10**7]}], max_new_tokens=2) == (
        "invalid_input"
    )


def test_prompt_over_max_prompt_tokens_is_too_large_with_no_token_stream(r: redis.Redis) -> None:
    longest = json.loads(r.get(key("info")) or b"{}")["max_prompt_tokens"]
    rid = submit(r, inputs=[{"prompt_token_ids": [5] * (longest + 1)}], stream=True)
    res = result(r, rid)
    assert res["status"] == "error" and res["error"]["code"] == "too_large"
    assert read_tokens(r, rid) == []


def test_unknown_model_is_answered_at_the_streams_key(r: redis.Redis) -> None:
    rid = uuid.uuid4().hex
    r.xadd(key("lane:0"), {"msgpack": msgpack.packb({"id": rid, "model": "other",
                                                     "inputs": [PROMPT]})})  # fmt: skip
    res = result(r, rid)
    assert res["status"] == "error" and res["error"]["code"] == "unknown_model"
    assert res["model"] == M


def test_unreadable_entry_goes_to_dead_letters(r: redis.Redis) -> None:
    before = r.xlen(key("dead"))
    source_id = r.xadd(key("lane:0"), {"msgpack": msgpack.packb([1, 2, 3])})
    end = time.monotonic() + WAIT_S
    while r.xlen(key("dead")) == before and time.monotonic() < end:
        time.sleep(0.05)
    dead: Any = r.xrevrange(key("dead"), count=1)
    _, fields = dead[0]
    assert fields[b"source_id"] == source_id and fields[b"code"] == b"malformed"
    assert fields[b"source"] == key("lane:0").encode() and b"orig_msgpack" in fields


# --- streaming: the token stream ------------------------------------------------------------


def test_token_stream_from_zero_rebuilds_the_result(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=20, ignore_eos=True, stream=True)
    entries = read_tokens(r, rid)
    res = result(r, rid)
    out = res["outputs"][0]
    seqs = [int(e["seq"]) for _, e in entries]
    assert seqs == list(range(1, len(entries) + 1))  # no gap, in order, from 1
    *pieces, (_, end) = entries
    assert end.get("end") == "1" and pieces
    assert all("life" in e and e["input"] == "0" for _, e in pieces)
    assert deltas_text(entries) == out["text"]
    assert sum(int(e["tokens"]) for _, e in pieces) == out["completion_tokens"] == 20
    assert int(pieces[0][1]["prompt_tokens"]) == out["prompt_tokens"]


def test_token_stream_from_a_middle_offset_and_after_the_end(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=12, ignore_eos=True, stream=True)
    entries = read_tokens(r, rid)
    middle = len(entries) // 2
    later = read_tokens(r, rid, after=entries[middle - 1][0])
    assert later == entries[middle:]
    assert r.xread({key(f"tokens:{rid}"): entries[-1][0]}, block=300) == []


def test_token_stream_carries_the_asked_extras(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=6, ignore_eos=True, stream=True,
                 logprobs=1, return_token_ids=True, return_prompt_text=True)  # fmt: skip
    entries = read_tokens(r, rid)
    out = result(r, rid)["outputs"][0]
    pieces = [e for _, e in entries if "end" not in e]
    assert [t for e in pieces for t in json.loads(e["token_ids"])] == out["token_ids"]
    assert [lp for e in pieces for lp in json.loads(e["logprobs"])] == out["logprobs"]
    assert pieces[0]["prompt_text"] == out["prompt_text"] == PROMPT
    assert json.loads(pieces[0]["prompt_token_ids"]) == out["prompt_token_ids"]


def test_token_stream_of_n_outputs_by_input_index(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT, "there were"], n=2, max_new_tokens=5, ignore_eos=True,
                 temperature=1.0, seed=4, stream=True)  # fmt: skip
    entries = read_tokens(r, rid)
    res = result(r, rid)
    assert {e["input"] for _, e in entries if "end" not in e} == {"0", "1", "2", "3"}
    for i, out in enumerate(res["outputs"]):
        assert deltas_text(entries, i) == out["text"]
    assert [int(e["seq"]) for _, e in entries] == list(range(1, len(entries) + 1))


def test_token_stream_and_started_key_live_with_the_results_ttl(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=4, stream=True, result_ttl_s=120)
    read_tokens(r, rid)
    result(r, rid)
    for suffix in ("result", "tokens", "started"):
        ttl = r.ttl(key(f"{suffix}:{rid}"))
        assert 0 < ttl <= 120, (suffix, ttl)
    assert r.get(key(f"started:{rid}")) == b"blind-1"


def test_results_default_ttl_is_an_hour(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=2)
    result(r, rid)
    assert 3500 < r.ttl(key(f"result:{rid}")) <= 3600


def test_unstreamed_request_has_no_token_stream(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=4)
    result(r, rid)
    assert not r.exists(key(f"tokens:{rid}"))


# --- streaming: reply-channel deltas --------------------------------------------------------


def listen(r: redis.Redis, channel: str) -> Any:
    """A subscription to ``channel``, made before submitting (as the doc says)."""
    pubsub = r.pubsub()
    pubsub.subscribe(channel)
    pubsub.get_message(timeout=5)  # the subscribe confirmation
    return pubsub


def collect(pubsub: Any, rid: str) -> list[dict[str, Any]]:
    """Messages for ``rid`` until its result (a map with a string status and no other kind)."""
    got: list[dict[str, Any]] = []
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        msg = pubsub.get_message(timeout=1.0)
        if msg is None or msg["type"] != "message":
            continue
        body = decode(msg["data"])
        if body.get("id") != rid:
            continue
        got.append(body)
        if body.get("kind", "result") == "result" and "status" in body:
            pubsub.close()
            return got
    raise TimeoutError(f"no result on the channel for {rid}")


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_reply_channel_deltas_then_the_result(r: redis.Redis, encoding: str) -> None:
    channel = f"svc-{uuid.uuid4().hex}"
    pubsub = listen(r, channel)
    rid = submit(r, encoding=encoding, inputs=[PROMPT], max_new_tokens=15, ignore_eos=True,
                 stream=True, reply=channel)  # fmt: skip
    got = collect(pubsub, rid)
    *deltas, final = got
    assert "kind" not in final and final["status"] == "ok"
    assert deltas and all(d["kind"] == "delta" and d["v"] == 1 for d in deltas)
    assert all(d["id"] == rid and d["model"] == M and d["input"] == 0 for d in deltas)
    assert [d["seq"] for d in deltas] == list(range(1, len(deltas) + 1))
    out = final["outputs"][0]
    assert "".join(d["text"] for d in deltas) == out["text"]
    assert sum(d["tokens"] for d in deltas) == out["completion_tokens"] == 15
    assert deltas[0]["prompt_tokens"] == out["prompt_tokens"]
    stream = [e for _, e in read_tokens(r, rid) if "end" not in e]
    assert [int(e["seq"]) for e in stream] == [d["seq"] for d in deltas]
    assert [e["text"] for e in stream] == [d["text"] for d in deltas]


def test_no_deltas_without_stream(r: redis.Redis) -> None:
    channel = f"svc-{uuid.uuid4().hex}"
    pubsub = listen(r, channel)
    rid = submit(r, inputs=[PROMPT], max_new_tokens=5, reply=channel)
    got = collect(pubsub, rid)
    assert len(got) == 1 and got[0]["status"] == "ok"


# --- cancel and deadlines -------------------------------------------------------------------


def test_cancel_key_stops_a_generation_with_the_text_so_far(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=CONTEXT - 16, ignore_eos=True, stream=True)
    end = time.monotonic() + WAIT_S
    while not r.xlen(key(f"tokens:{rid}")) and time.monotonic() < end:
        time.sleep(0.01)
    r.set(key(f"cancel:{rid}"), 1, ex=3600)
    res = result(r, rid)
    out = res["outputs"][0]
    assert res["status"] == "ok" and out["finish_reason"] == "cancelled"
    assert 1 <= out["completion_tokens"] < CONTEXT - 16
    entries = read_tokens(r, rid)
    assert entries[-1][1].get("end") == "1"
    assert deltas_text(entries) == out["text"]


@contextmanager
def occupied(r: redis.Redis) -> Iterator[None]:
    """Every running slot of the worker (the fixture's max_running 16) taken by one long
    request of 16 completions, started; cancelled afterwards."""
    big = submit(r, inputs=[PROMPT], n=16, max_new_tokens=CONTEXT - 16, ignore_eos=True,
                 temperature=1.0)  # fmt: skip
    end = time.monotonic() + WAIT_S
    while not r.exists(key(f"started:{big}")) and time.monotonic() < end:
        time.sleep(0.01)
    try:
        yield
    finally:
        r.set(key(f"cancel:{big}"), 1, ex=3600)
        assert result(r, big)["outputs"][0]["finish_reason"] == "cancelled"


def test_deadline_before_start_is_expired_and_never_computed(r: redis.Redis) -> None:
    # A 1 ms deadline is not enough: an idle worker may start a request 0.6 ms in (then
    # it ends ok, finish_reason deadline). Here it waits for a slot past its deadline.
    with occupied(r):
        rid = submit(r, inputs=[PROMPT], max_new_tokens=5, deadline_ms=500)
        res = result(r, rid)
    assert res["status"] == "expired" and res["error"]["code"] == "deadline_exceeded"
    assert "outputs" not in res and res["timings"]["batch_size"] == 0
    assert not r.exists(key(f"started:{rid}"))  # never admitted


def test_cancel_while_waiting_is_ok_with_empty_text(r: redis.Redis) -> None:
    with occupied(r):
        rid = submit(r, inputs=[PROMPT], max_new_tokens=5, stream=True)
        r.set(key(f"cancel:{rid}"), 1, ex=3600)
        res = result(r, rid)
    assert res["status"] == "ok"
    assert [(o["text"], o["finish_reason"]) for o in res["outputs"]] == [("", "cancelled")]
    assert not r.exists(key(f"started:{rid}"))
    assert [e for _, e in read_tokens(r, rid)][-1].get("end") == "1"


def test_deadline_mid_generation_ends_ok_with_the_text_so_far(r: redis.Redis) -> None:
    rid = submit(r, inputs=[PROMPT], max_new_tokens=CONTEXT - 16, ignore_eos=True,
                 deadline_ms=3000, stream=True)  # fmt: skip
    res = result(r, rid)
    assert res["status"] == "ok", res
    out = res["outputs"][0]
    assert out["finish_reason"] == "deadline"
    assert 1 <= out["completion_tokens"] < CONTEXT - 16
    assert deltas_text(read_tokens(r, rid)) == out["text"]
    assert res["timings"]["first_token_ms"] > 0


def test_timings_of_a_generation(r: redis.Redis) -> None:
    res = ask(r, inputs=[PROMPT], max_new_tokens=5, ignore_eos=True)
    t = res["timings"]
    for name in ("queued_ms", "batch_wait_ms", "inference_ms", "total_ms", "first_token_ms"):
        assert t[name] >= 0, name
    assert t["first_token_ms"] <= t["total_ms"]
    assert t["batch_size"] >= 1 and t["batch_id"] and t["worker"] == "blind-1"


# --- lanes ----------------------------------------------------------------------------------


def test_every_lane_is_served(r: redis.Redis) -> None:
    lanes = int(r.get(key("lanes")) or 3)
    ids = [submit(r, lane=lane, inputs=[PROMPT], max_new_tokens=2) for lane in range(lanes)]
    assert all(result(r, rid)["status"] == "ok" for rid in ids)
    assert all(r.xlen(key(f"lane:{lane}")) == 0 for lane in range(lanes))  # acked + deleted


def test_submit_script_adds_under_the_depth_limit(r: redis.Redis) -> None:
    script = (
        "local max = tonumber(redis.call('GET', KEYS[2]) or '0') or 0\n"
        "if max > 0 then\n"
        "  local depth = redis.call('XLEN', KEYS[1])\n"
        "  if depth >= max then\n"
        "    return redis.error_reply('QUEUEFULL ' .. KEYS[1] .. ' holds ' .. depth .. ' >= ' .. max)\n"
        "  end\n"
        "end\n"
        "return redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])\n"
    )
    rid = uuid.uuid4().hex
    body = json.dumps({"id": rid, "model": M, "inputs": [PROMPT], "max_new_tokens": 2})
    r.eval(script, 2, key("lane:1"), key("max-depth"), "json", body)
    assert result(r, rid)["status"] == "ok"


# --- a duplicate id, a restart --------------------------------------------------------------


def test_the_same_id_twice_gets_one_result(r: redis.Redis) -> None:
    rid = uuid.uuid4().hex
    first = ask(r, id=rid, inputs=[PROMPT], max_new_tokens=3, temperature=1.0, seed=1)
    submit(r, id=rid, inputs=[PROMPT], max_new_tokens=3, temperature=1.0, seed=2)
    end = time.monotonic() + WAIT_S
    while r.xlen(key("lane:0")) and time.monotonic() < end:
        time.sleep(0.05)
    assert result(r, rid) == first


def test_a_takeover_restarts_the_stream_from_seq_one(
    fleet: tuple[redis.Redis, WorkerProcess, Path],
) -> None:
    """Last in the module: it kills the module's worker. A second worker takes the request
    over; the stream's seq starts again at 1 (the reset), and one result comes."""
    r, first, tmp = fleet
    rid = submit(r, inputs=[PROMPT], max_new_tokens=CONTEXT - 16, ignore_eos=True, stream=True)
    end = time.monotonic() + WAIT_S
    while r.xlen(key(f"tokens:{rid}")) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    first.kill()
    before: Any = r.xrange(key(f"tokens:{rid}"))
    second = WorkerProcess(tmp / "fleet.toml", "blind-2", tmp / "blind-2.log")
    try:
        second.wait_ready(r, M)
        # the restarted request must not run 4000 tokens: cancel it once it restarted
        while time.monotonic() < end:
            now: Any = r.xrange(key(f"tokens:{rid}"))
            seqs = [int(f[b"seq"]) for _, f in now]
            if len(seqs) > len(before) + 1:
                break
            time.sleep(0.05)
        r.set(key(f"cancel:{rid}"), 1, ex=3600)
        res = result(r, rid)
        assert res["status"] == "ok" and res["timings"]["worker"] == "blind-2"
        entries = read_tokens(r, rid)
        seqs = [int(e["seq"]) for _, e in entries]
        lives = [int(e["life"]) for _, e in entries if "life" in e]
        reset = next(i for i in range(1, len(seqs)) if seqs[i] <= seqs[i - 1])
        assert seqs[reset] == 1 and reset >= len(before)
        assert lives == sorted(lives) and lives[-1] > lives[0]
        assert deltas_text(entries[reset:]) == res["outputs"][0]["text"]
    finally:
        second.stop()
