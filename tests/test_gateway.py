"""The OpenAI-compatible gateway, end to end: the official `openai` client (and raw HTTP
where the client hides what is checked) → `batchfleet gateway` (a real process) → Redis →
a real worker generating with a tiny random Llama. Answers are compared with the same
requests sent through the Python producer (greedy decoding: the same text)."""

from __future__ import annotations

import array
import base64
import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import openai
import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Delta
from batchfleet.schemas.model_info import decode_model_info
from conftest import WorkerProcess, fleet_toml
from tiny_models import make_causal_lm, make_classifier, make_embedding_model
from tiny_vision import make_cross_encoder

from batchfleet.redis_server import LocalRedis, free_port
from batchfleet.tied_process import tied_popen

pytestmark = pytest.mark.timeout(240)

LM = "tinylm"
KEY = "sk-test-gateway"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]  # fmt: skip


@dataclass
class Fleet:
    url: str
    base: str
    """The gateway's http://host:port."""
    client: openai.OpenAI
    r: redis.Redis


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("gateway")
    models = {
        "embed": {"runner": "embedding", "path": str(make_embedding_model(tmp / "e")),
                  "max_tokens": 64},
        "ranker": {"runner": "rerank", "path": str(make_cross_encoder(tmp / "x")),
                   "max_tokens": 64},
        "sentiment": {"runner": "text-classification", "path": str(make_classifier(tmp / "c")),
                      "max_tokens": 64},
    }  # fmt: skip
    with serving(tmp, models) as fleet:
        yield fleet


@contextlib.contextmanager
def serving(
    tmp: Path, more: dict[str, dict[str, Any]] | None = None, template: str | None = None
) -> Iterator[Fleet]:
    """A fleet (Redis, one worker) serving the tiny Llama as ``LM`` (hermes tool calls; its
    chat ``template`` where given) and the ``more`` models, and a gateway in front of it."""
    lm = make_causal_lm(tmp / "lm", context=4096, template=template)
    opts = {"kv_cache_tokens": 8192, "page_size": 16, "step_tokens": 64, "max_running": 16,
            "tool_call_parser": "hermes", "max_new_tokens": 4000}  # fmt: skip
    config = tmp / "fleet.toml"
    models = {LM: {"runner": "text-generation", "path": str(lm), "options": opts}, **(more or {})}
    server = LocalRedis()
    server.start()
    r = redis.Redis.from_url(server.url)
    worker = gateway = None
    try:
        config.write_text(fleet_toml(server.url, models))
        worker = WorkerProcess(config, "gw-worker", tmp / "worker.log")
        for model in models:
            worker.wait_ready(r, model)
        gateway, base = start_gateway(server.url, tmp)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        yield Fleet(server.url, base, client, r)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        if worker is not None:
            worker.stop()
        r.close()
        server.stop()


def start_gateway(url: str, tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """`batchfleet gateway` on a free port, once its /health answers; its base URL."""
    port = free_port()
    log = tmp / f"gateway-{port}.log"
    with log.open("wb") as out:
        gateway = tied_popen(
            [sys.executable, "-m", "batchfleet", "gateway", "--redis-url", url,
             "--port", str(port), "--api-key", KEY, *extra],
            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
    end = time.monotonic() + 60
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return gateway, f"http://127.0.0.1:{port}"
        except OSError:
            pass
        finally:
            conn.close()
        if gateway.poll() is not None or time.monotonic() > end:
            gateway.kill()
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.1)


def producer_text(fleet: Fleet, **options: Any) -> str:
    with Producer(fleet.url) as p:
        return p.submit(LM, **options).text(timeout=120)


def raw(fleet: Fleet, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    """One plain HTTP call: status and JSON answer."""
    conn = http.client.HTTPConnection(fleet.base.removeprefix("http://"), timeout=60)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def test_chat_whole_and_streamed_match_the_producer(fleet: Fleet) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                             {"type": "text", "text": "a story"}]}]  # fmt: skip
    # Given a chat, its text through the Python producer (greedy)
    expected = producer_text(fleet, messages=[messages[0], {"role": "user",
                             "content": "Tell me\na story"}], max_new_tokens=24)  # fmt: skip
    # When the same chat is asked of the gateway with the openai client, whole
    whole = fleet.client.chat.completions.with_raw_response.create(
        model=LM, messages=messages, max_tokens=24
    )  # type: ignore[arg-type]
    reply = whole.parse()
    # Then it is the same text, with OpenAI's fields
    (choice,) = reply.choices
    assert choice.message.content == expected and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and reply.object == "chat.completion"
    assert reply.usage is not None and reply.usage.completion_tokens == 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24 > 24
    assert reply.id == f"chatcmpl-{whole.headers['x-request-id']}"
    # and streamed, the pieces add up to it, the role first, the usage last
    chunks = list(fleet.client.chat.completions.create(
        model=LM, messages=messages, max_tokens=24, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: each chunk's usage so far, from the prompt on
    chunks = list(fleet.client.chat.completions.create(
        model=LM, messages=messages, max_tokens=24, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]  # fmt: skip
    counts = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks if c.usage]
    assert len(counts) == len(chunks) and set(p for p, _ in counts) == {reply.usage.prompt_tokens}
    assert counts[0][1] == 0 and counts[-1][1] == 24 and counts == sorted(counts)


def test_sampling_fields_and_n(fleet: Fleet) -> None:
    # Given a seeded sampled chat with n = 3 and logprobs
    ask = {"model": LM, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
           "temperature": 1.5, "seed": 7, "n": 3, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    reply = fleet.client.chat.completions.create(**ask)  # type: ignore[call-overload]
    again = fleet.client.chat.completions.create(**ask)  # type: ignore[call-overload]
    # Then 3 choices, indexed, the same text for the same seed, logprobs per token
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [c.message.content for c in again.choices]
    for c in reply.choices:
        assert c.logprobs is not None and c.logprobs.content is not None
        assert len(c.logprobs.content) == 8
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    # and vLLM's extras pass through (top_k = 1 is greedy whatever the temperature)
    greedy = producer_text(fleet, messages=[{"role": "user", "content": "hello"}],
                           max_new_tokens=8)  # fmt: skip
    topk = fleet.client.chat.completions.create(
        model=LM, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=1.0, extra_body={"top_k": 1})  # fmt: skip
    assert topk.choices[0].message.content == greedy


def test_completions_prompts_n_echo_logprobs_and_tokens(fleet: Fleet) -> None:
    prompts = ["the cat", "a dog ran"]
    expected = [producer_text(fleet, inputs=p, max_new_tokens=6) for p in prompts]
    # Given two prompts, n = 2 each, with echo
    reply = fleet.client.completions.create(model=LM, prompt=prompts, max_tokens=6, n=2,
                                            echo=True)  # fmt: skip
    # Then 4 choices, input by input, each the prompt and its text
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [p + e for p, e in zip(prompts, expected, strict=True)
                                               for _ in range(2)]  # fmt: skip
    assert reply.object == "text_completion" and reply.usage is not None
    # and logprobs in the legacy shape, offsets into the text
    lp = fleet.client.completions.create(model=LM, prompt="the cat", max_tokens=6, logprobs=3)
    (c,) = lp.choices
    assert c.logprobs is not None and c.logprobs.tokens is not None
    assert "".join(c.logprobs.tokens) == c.text == expected[0]
    assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i])) for i in range(6)]
    assert all(len(t) <= 3 for t in c.logprobs.top_logprobs or [])
    # and a prompt of token ids goes on as given
    ids = fleet.client.completions.create(model=LM, prompt=[5, 6, 7], max_tokens=4,
                                          extra_body={"return_token_ids": True})  # fmt: skip
    assert ids.choices[0].model_extra is not None
    assert ids.choices[0].model_extra["prompt_token_ids"] == [5, 6, 7]
    # and streamed, each choice's pieces add up to its text
    pieces: dict[int, str] = {}
    for chunk in fleet.client.completions.create(model=LM, prompt=prompts, max_tokens=6,
                                                 stream=True):  # fmt: skip
        for ch in chunk.choices:
            pieces[ch.index] = pieces.get(ch.index, "") + ch.text
    assert pieces == {0: expected[0], 1: expected[1]}


def test_streamed_token_ids_lead_with_the_prompt_s_as_whole(fleet: Fleet) -> None:
    """vLLM's ``return_token_ids`` streamed: each choice's first chunk carries its prompt's
    ``prompt_token_ids`` (a chat's on the chunk, a completion's in the choice), and its
    chunks' ``token_ids`` add up to the whole answer's."""
    extra = {"extra_body": {"return_token_ids": True}}
    chat = {"model": LM, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "n": 2}  # fmt: skip
    text = {"model": LM, "prompt": [[9, 8], [5, 6, 7]], "max_tokens": 6, "n": 2}
    for create, ask in ((fleet.client.chat.completions.create, chat),
                        (fleet.client.completions.create, text)):  # fmt: skip
        # Given the whole answer (greedy: n 2 gives each input's text twice)
        whole = create(**ask, **extra).model_dump()  # type: ignore[operator]
        # When it is streamed
        chunks = [c.model_dump() for c in create(**ask, **extra, stream=True)]  # type: ignore[operator]
        for w in whole["choices"]:
            mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == w["index"]]
            holders = [c if "messages" in ask else c["choices"][0] for c in mine]
            # Then its first chunk, and no other, has the prompt's ids, the whole's
            prompt = whole["prompt_token_ids"] if "messages" in ask else w["prompt_token_ids"]
            assert holders[0]["prompt_token_ids"] == prompt, (ask, w["index"])
            assert all(h.get("prompt_token_ids") is None for h in holders[1:])
            assert [t for c in mine for t in c["choices"][0].get("token_ids") or []] == (
                w["token_ids"])  # fmt: skip
        if "prompt" in ask:
            assert [w["prompt_token_ids"] for w in whole["choices"]] == [[9, 8]] * 2 + [
                [5, 6, 7]] * 2  # fmt: skip


def produced(fleet: Fleet, **options: Any) -> Any:
    """The first output of ``options`` asked of the fleet through the Python producer."""
    with Producer(fleet.url) as p:
        return p.submit(LM, **options).result(timeout=120).generations()[0]


def test_tokenize_detokenize_and_prompt_scoring(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return raw(fleet, "POST", path, json.dumps(body).encode(), auth)

    # Given a prompt and a chat, their tokens as the worker reads them for a generation
    text = produced(fleet, inputs="the cat sat", max_new_tokens=1, return_token_ids=True)
    chat = [{"role": "user", "content": "hello"}]
    rendered = produced(fleet, messages=chat, max_new_tokens=1, return_token_ids=True)
    # When /tokenize is asked for them, Then the same ids, generating nothing
    status, body = post("/tokenize", {"model": LM, "prompt": "the cat sat"})
    assert status == 200, body
    assert body == {"count": text.prompt_tokens, "max_model_len": 4096,
                    "tokens": text.prompt_token_ids, "token_strs": None}  # fmt: skip
    status, body = post("/tokenize", {"model": LM, "messages": chat})
    assert status == 200 and body["tokens"] == rendered.prompt_token_ids
    # and /detokenize gives the text back
    status, body = post("/detokenize", {"model": LM, "tokens": text.prompt_token_ids})
    assert (status, body) == (200, {"prompt": "the cat sat"})
    # a token the model does not have is the worker's refusal
    status, body = post("/detokenize", {"model": LM, "tokens": [10**6]})
    assert status == 400 and body["error"]["code"] == "invalid_input"
    # the tokenizer's strings of them (vLLM's token_strs), and add_special_tokens as asked
    # (this tokenizer adds none to a text: the same ids; a chat's template has its own)
    status, body = post("/tokenize", {"model": LM, "prompt": "the cat sat",
                                      "return_token_strs": True, "add_special_tokens": False})  # fmt: skip
    assert status == 200 and body["tokens"] == text.prompt_token_ids
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "the cat sat"
    assert len(body["token_strs"]) == body["count"] == text.prompt_tokens
    status, body = post("/tokenize", {"model": LM, "messages": chat, "add_special_tokens": True})
    assert status == 200 and body["tokens"] == rendered.prompt_token_ids
    status, body = post("/tokenize", {"model": LM, "prompt": "a", "add_special_tokens": "no"})
    assert status == 400 and body["error"]["param"] == "add_special_tokens"
    # lm-evaluation-harness's loglikelihood: echo, logprobs, max_tokens 0 scores the prompt
    scored = produced(fleet, inputs="the cat sat", max_new_tokens=1, prompt_logprobs=1)
    reply = fleet.client.completions.create(model=LM, prompt="the cat sat", echo=True,
                                            logprobs=1, max_tokens=0)  # fmt: skip
    (c,) = reply.choices
    assert c.text == "the cat sat" and c.logprobs is not None and c.logprobs.tokens is not None
    assert "".join(c.logprobs.tokens) == "the cat sat" == "".join(
        [c.logprobs.tokens[0], *(t.text for t in scored.prompt_logprobs[1:])])  # fmt: skip
    assert c.logprobs.token_logprobs is not None and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        [t.logprob for t in scored.prompt_logprobs[1:]], abs=1e-4)  # fmt: skip
    assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i]))
                                      for i in range(len(c.logprobs.tokens))]  # fmt: skip
    assert reply.usage is not None and reply.usage.prompt_tokens == text.prompt_tokens
    assert reply.usage.completion_tokens == 0
    # and with tokens generated, theirs follow the prompt's
    more = fleet.client.completions.create(model=LM, prompt="the cat sat", echo=True,
                                           logprobs=1, max_tokens=3)  # fmt: skip
    (m,) = more.choices
    assert m.logprobs is not None and m.logprobs.token_logprobs is not None
    assert m.logprobs.token_logprobs[0] is None
    assert m.logprobs.token_logprobs[1 : text.prompt_tokens] == pytest.approx(
        c.logprobs.token_logprobs[1:], abs=1e-4)  # fmt: skip
    assert len(m.logprobs.token_logprobs) == text.prompt_tokens + 3
    assert m.text == "the cat sat" + producer_text(fleet, inputs="the cat sat", max_new_tokens=3)
    # a prompt of token ids echoes as the worker decodes it
    ids = fleet.client.completions.create(model=LM, prompt=text.prompt_token_ids, echo=True,
                                          max_tokens=0)  # fmt: skip
    assert ids.choices[0].text == "the cat sat"


def test_a_streamed_echo_adds_up_to_the_whole_answer(fleet: Fleet) -> None:
    """vLLM streams ``echo`` with ``logprobs`` and token-id prompts: each choice opens
    with its prompt (its tokens' log-probabilities, the first null), then its deltas."""
    # Given the fleet's token stream of such a request: its first delta tells the prompt
    with Producer(fleet.url) as p:
        job = p.submit(LM, inputs="the cat sat", max_new_tokens=3, stream=True,
                       prompt_logprobs=1, return_prompt_text=True)  # fmt: skip
        deltas = [d for d in job.deltas(timeout=120) if isinstance(d, Delta)]
        out = job.result(timeout=120).generations()[0]
    assert deltas[0].prompt_text == out.prompt_text == "the cat sat"
    assert deltas[0].prompt_logprobs == out.prompt_logprobs and out.prompt_logprobs
    assert all(d.prompt_text is None and d.prompt_logprobs is None for d in deltas[1:])
    ids = produced(fleet, inputs="a dog ran", max_new_tokens=1,
                   return_token_ids=True).prompt_token_ids  # fmt: skip
    for prompt, more in ((["the cat sat", "a dog ran"], {"logprobs": 1}), ([ids], {}),
                         ([ids], {"logprobs": 0}), (["the cat sat"], {"logprobs": 2})):  # fmt: skip
        for max_tokens in (5, 0):
            # Given a completion asked whole, greedy: n 2 gives each input's text twice
            ask = {"model": LM, "prompt": prompt, "echo": True, "max_tokens": max_tokens,
                   "n": 2, **more}  # fmt: skip
            whole = fleet.client.completions.create(**ask)
            # When it is streamed
            pieces: dict[int, list[Any]] = {}
            for chunk in fleet.client.completions.create(**ask, stream=True):
                for ch in chunk.choices:
                    pieces.setdefault(ch.index, []).append(ch)
            # Then each choice's chunks add up to its whole text and logprobs, prompt first
            assert sorted(pieces) == [c.index for c in whole.choices] == [0, 1, 2, 3][
                : 2 * len(prompt)]  # fmt: skip
            for c in whole.choices:
                mine = pieces[c.index]
                assert "".join(ch.text for ch in mine) == c.text, (ask, c.index)
                echo = prompt[c.index // 2]
                assert mine[0].text == (echo if isinstance(echo, str) else "a dog ran")
                assert mine[-1].finish_reason == c.finish_reason
                if c.logprobs is None:
                    assert all(ch.logprobs is None for ch in mine)
                    continue
                streamed: dict[str, list[Any]] = {}
                for ch in mine:
                    for k, v in (ch.logprobs.model_dump() if ch.logprobs else {}).items():
                        streamed.setdefault(k, []).extend(v)
                assert streamed == c.logprobs.model_dump()
                assert c.logprobs.token_logprobs is not None
                assert c.logprobs.token_logprobs[0] is None
                assert mine[0].logprobs is not None and mine[0].logprobs.text_offset
                assert mine[0].logprobs.text_offset[0] == 0


def test_stop_reason_names_the_stop_string(fleet: Fleet) -> None:
    whole = producer_text(fleet, inputs="the cat", max_new_tokens=24)
    stop = next(whole[i : i + 3] for i in range(4, len(whole) - 3) if whole[i : i + 3].strip())
    # Given a stop string from the middle of the greedy text, When it ends the text
    reply = fleet.client.completions.create(model=LM, prompt="the cat", max_tokens=24,
                                            stop=[stop])  # fmt: skip
    (c,) = reply.choices
    # Then the choice names it (vLLM's stop_reason), whole and streamed
    assert c.finish_reason == "stop" and c.model_extra is not None
    assert c.model_extra["stop_reason"] == stop
    ends = [ch for chunk in fleet.client.completions.create(
        model=LM, prompt="the cat", max_tokens=24, stop=[stop], stream=True)
        for ch in chunk.choices if ch.finish_reason]  # fmt: skip
    assert [(e.finish_reason, (e.model_extra or {}).get("stop_reason")) for e in ends] == [
        ("stop", stop)]  # fmt: skip
    # and a text that reached max_tokens has none
    long = fleet.client.completions.create(model=LM, prompt="the cat", max_tokens=2)
    assert (long.choices[0].model_extra or {}).get("stop_reason") is None


def test_tool_calls_whole_and_streamed(fleet: Fleet) -> None:
    # Given tools and tool_choice "required" (the grammar makes the random model call one)
    ask = {"model": LM, "messages": [{"role": "user", "content": "weather?"}], "tools": WEATHER,
           "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200}  # fmt: skip
    reply = fleet.client.chat.completions.create(**ask)  # type: ignore[call-overload]
    (choice,) = reply.choices
    # Then the call is OpenAI's, and the finish reason says so
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)
    # and streamed, the calls' pieces add up to the same calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in fleet.client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        for d in chunk.choices:
            finish = d.finish_reason or finish
            for tc in d.delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += tc.function.name or "" if tc.function else ""
                slot["arguments"] += tc.function.arguments or "" if tc.function else ""
    assert finish == "tool_calls" and calls
    assert [c["name"] for c in calls.values()] == [c.function.name for c in
                                                    choice.message.tool_calls]  # fmt: skip
    assert all(json.loads(c["arguments"]) for c in calls.values())
    # and a past call and its answer go back in as OpenAI writes them
    follow = fleet.client.chat.completions.create(
        model=LM, max_tokens=4, messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
             "refusal": None},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], tools=WEATHER)  # type: ignore[list-item]  # fmt: skip
    assert follow.choices[0].message.content is not None


def test_errors_are_openai_errors(fleet: Fleet) -> None:
    c = fleet.client
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.code == "model_not_found"
    # a value the fleet refuses (the producer's own validation): 400 with its code
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=LM, messages=[{"role": "user", "content": "x"}],
                                  temperature=-1)  # fmt: skip
    assert bad.value.code == "invalid_request" and "temperature" in str(bad.value)
    assert bad.value.param == "temperature"  # named, as OpenAI and vLLM do
    for stream in (False, True):  # under the route's own name of the field
        with pytest.raises(openai.BadRequestError) as bad:
            out = c.chat.completions.create(model=LM, messages=[{"role": "user", "content": "x"}],
                                            max_completion_tokens=-2, stream=stream)  # fmt: skip
            list(out) if stream else None  # type: ignore[call-overload]
        assert bad.value.param == "max_completion_tokens"
    # a refusal the worker answers (a prompt over its bound): 400, streamed or not
    long = "the cat " * 1200
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ctx:
            out = c.completions.create(model=LM, prompt=long, max_tokens=4, stream=stream)
            list(out) if stream else None  # type: ignore[call-overload]
        assert ctx.value.code == "too_large" and "prompt tokens" in str(ctx.value)
    # a field checked against the model: a thinking budget, to a model without reasoning
    # markers, is refused (by the gateway, as its workers published they take none)
    for ask in (lambda: c.chat.completions.create(
                    model=LM, messages=[{"role": "user", "content": "x"}],
                    extra_body={"thinking_token_budget": 4}),
                lambda: c.completions.create(model=LM, prompt="x", max_tokens=4,
                                             extra_body={"thinking_token_budget": 4})):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as ctx:
            ask()
        assert ctx.value.code == "invalid_request" and "reasoning markers" in str(ctx.value)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        c.chat.completions.create(model=LM, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])  # fmt: skip
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{fleet.base}/v1", api_key="wrong", max_retries=0).models.list()
    auth = {"Authorization": f"Bearer {KEY}"}
    status, body = raw(fleet, "POST", "/v1/chat/completions", b"{not json", auth)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = raw(fleet, "GET", "/v1/nothing", None, auth)
    assert status == 404 and "error" in body


def test_models_and_request_ids(fleet: Fleet) -> None:
    assert [m.id for m in fleet.client.models.list()] == sorted([LM, "embed", "ranker",
                                                                 "sentiment"])  # fmt: skip
    assert fleet.client.models.retrieve(LM).owned_by == "batchfleet"
    # the worker published each model's info: the tiny Llama's context (its 4096 positions,
    # within its 8192-token cache), the encoders' tokens per input (max_tokens 64)
    info = decode_model_info(fleet.r.get(ModelKeys(LM).info) or b"")
    assert (info.task, info.max_model_len, info.max_new_tokens) == ("text-generation", 4096,
                                                                    4096)  # fmt: skip
    assert (info.chat_template, info.tool_call_parser, info.reasoning_parser) == (True, "hermes",
                                                                                   None)  # fmt: skip
    assert info.created > 0
    lens = {m.id: (m.model_extra or {}).get("max_model_len") for m in fleet.client.models.list()}
    assert lens == {LM: 4096, "embed": 64, "ranker": 64, "sentiment": 64}
    embed = decode_model_info(fleet.r.get(ModelKeys("embed").info) or b"")
    assert (embed.task, embed.max_model_len, embed.chat_template) == ("embedding", 64, None)
    # a request id chosen by the client names the fleet request; sent again, it gets the
    # same single result (nothing is generated twice)
    rid = uuid.uuid4().hex
    ask = {"model": LM, "prompt": "the cat", "max_tokens": 5, "temperature": 1.0}
    first = fleet.client.completions.create(**ask, extra_headers={"X-Request-Id": rid})
    second = fleet.client.completions.create(**ask, extra_headers={"X-Request-Id": rid})
    assert first.id == second.id == f"cmpl-{rid}" and first.choices == second.choices
    stored = msgpack.unpackb(fleet.r.get(ModelKeys(LM).result(rid)))
    assert stored["outputs"][0]["text"] == first.choices[0].text


def test_a_client_that_leaves_mid_stream_cancels_its_request(fleet: Fleet) -> None:
    body = {"model": LM, "prompt": "the cat", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    # Given a long streamed generation, read until its text flows, When the client closes
    # the connection
    out = leave_mid_stream(fleet, "/v1/completions", body, lambda line: line.startswith(
        b"data: ") and bool(json.loads(line[6:])["choices"][0]["text"]))  # fmt: skip
    # Then the fleet stops it: cancelled, short
    assert out["finish_reason"] == "cancelled" and out["completion_tokens"] < 4000


def leave_mid_stream(
    fleet: Fleet, path: str, body: dict[str, Any], flowing: Callable[[bytes], bool]
) -> dict[str, Any]:
    """Stream ``body`` under a new request id, read it up to the first line ``flowing``
    (its text flows), close the connection: the request's output once stored."""
    rid = uuid.uuid4().hex
    conn, response = open_stream(fleet.base, path, body, rid)
    while (line := response.readline()) and not flowing(line):
        pass
    conn.close()
    return stored_output(fleet.r, rid)


def open_stream(
    base: str, path: str, body: dict[str, Any], rid: str
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed request under the client's own id, as raw HTTP, once its events began."""
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
    conn.request("POST", path, json.dumps(body).encode(),
                 {"Authorization": f"Bearer {KEY}", "X-Request-Id": rid})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    return conn, response


def stored_output(r: redis.Redis, rid: str) -> dict[str, Any]:
    """The one output of request ``rid``'s result, once stored (within a minute)."""
    key = ModelKeys(LM).result(rid)
    end = time.monotonic() + 60
    while (raw := r.get(key)) is None and time.monotonic() < end:
        time.sleep(0.05)
    assert raw is not None
    (out,) = msgpack.unpackb(raw)["outputs"]
    return dict(out)


def probe(base: str) -> tuple[int | None, int | None]:
    """The status of GET /health and of a new POST, None where the connection fails."""
    statuses: list[int | None] = []
    for method, path in (("GET", "/health"), ("POST", "/v1/completions")):
        conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=10)
        body = json.dumps({"model": LM, "prompt": "x", "max_tokens": 1}).encode()
        try:
            conn.request(method, path, body if method == "POST" else None,
                         {"Authorization": f"Bearer {KEY}"})  # fmt: skip
            statuses.append(conn.getresponse().status)
        except OSError:
            statuses.append(None)
        finally:
            conn.close()
    return statuses[0], statuses[1]


def test_sigterm_lets_requests_in_flight_end_then_cancels_them(
    fleet: Fleet, tmp_path: Path
) -> None:
    # Given a second gateway (a grace of 1 s) streaming a long generation
    gateway, base = start_gateway(fleet.url, tmp_path, "--grace", "1")
    rid = uuid.uuid4().hex
    body = {"model": LM, "prompt": "the cat", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    conn, response = open_stream(base, "/v1/completions", body, rid)
    assert response.readline().startswith(b"data: ")
    # When it gets SIGTERM
    gateway.terminate()
    # Then, once the signal is handled, it is not ready and takes no new request: it no
    # longer listens, or (while it stops listening) answers 503
    end = time.monotonic() + 30
    while 200 in (answers := probe(base)) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(status in (None, 503) for status in answers), answers
    # And once the grace is over it cancels the one in flight in the fleet, and exits
    assert gateway.wait(30) == 0
    conn.close()
    out = stored_output(fleet.r, rid)
    assert out["finish_reason"] == "cancelled" and out["completion_tokens"] < 4000


def test_tokens_as_token_ids_by_request_and_by_the_gateway_s_flag(
    fleet: Fleet, tmp_path: Path
) -> None:
    # Given a chat and a completion with logprobs, and their tokens as the fleet has them
    chat = {"model": LM, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    text = {"model": LM, "prompt": "the cat", "max_tokens": 6, "logprobs": 2}
    fleet_ids = {
        "chat": produced(fleet, messages=chat["messages"], max_new_tokens=6,
                         return_token_ids=True).token_ids,
        "text": produced(fleet, inputs="the cat", max_new_tokens=6,
                         return_token_ids=True).token_ids,
    }  # fmt: skip

    def tokens(base: str, body: dict[str, Any], **more: Any) -> list[list[str]]:
        """The completion's tokens (and each position's alternatives), whole and streamed;
        the chat's too where ``body`` is one."""
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        ask = body | {"extra_body": more}
        if "messages" in body:
            whole = client.chat.completions.create(**ask).choices[0].logprobs
            streamed = [t for c in client.chat.completions.create(**ask, stream=True)
                        if c.choices and c.choices[0].logprobs
                        for t in c.choices[0].logprobs.content or ()]  # fmt: skip
            assert whole is not None and whole.content is not None
            got = [[t.token for t in whole.content],
                   [x.token for t in whole.content for x in t.top_logprobs]]  # fmt: skip
            assert [[t.token for t in streamed],
                    [x.token for t in streamed for x in t.top_logprobs]] == got  # fmt: skip
            return got
        lp = client.completions.create(**ask).choices[0].logprobs
        streamed = [t for c in client.completions.create(**ask, stream=True)
                    if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or ()]  # fmt: skip
        assert lp is not None and lp.tokens is not None and streamed == lp.tokens
        return [lp.tokens, sorted(k for top in lp.top_logprobs or () for k in top)]

    # When asked of a plain gateway, then of one started with --return-tokens-as-token-ids
    flagged, base = start_gateway(fleet.url, tmp_path, "--return-tokens-as-token-ids")
    try:
        for body in (chat, text):
            # Then the plain gateway names tokens by their text unless a request asks ids
            plain, asked = tokens(fleet.base, body), tokens(fleet.base, body,
                                                            return_tokens_as_token_ids=True)  # fmt: skip
            named = [f"token_id:{t}" for t in fleet_ids["chat" if body is chat else "text"]]
            assert asked[0] == named and all(k.startswith("token_id:") for k in asked[1])
            assert not any(t.startswith("token_id:") for t in plain[0] + plain[1])
            # and the flagged one names them by id unless a request asks its text
            assert tokens(base, body) == asked
            assert tokens(base, body, return_tokens_as_token_ids=False) == plain
    finally:
        flagged.terminate()
        flagged.wait(10)


def test_beam_search_takes_temperature(fleet: Fleet) -> None:
    # vLLM's beams take a temperature (each round draws a candidate that can only end a
    # beam): a warm request is answered, not refused
    ask = {"model": LM, "prompt": "the cat", "max_tokens": 5, "n": 2,
           "extra_body": {"use_beam_search": True}}  # fmt: skip
    cold = fleet.client.completions.create(**ask)
    warm = fleet.client.completions.create(**ask, temperature=0.7, seed=5)
    assert len(warm.choices) == 2 and all(c.text for c in warm.choices)
    assert len(cold.choices) == 2


def test_vllm_guided_fields_and_structured_outputs(fleet: Fleet) -> None:
    reply = fleet.client.chat.completions.create(
        model=LM, messages=[{"role": "user", "content": "pick"}], max_tokens=20,
        extra_body={"guided_choice": ["red", "green"]})  # fmt: skip
    assert reply.choices[0].message.content in ("red", "green")
    schema = {"enum": ["yes", "no"]}
    js = fleet.client.chat.completions.create(
        model=LM, messages=[{"role": "user", "content": "json"}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})  # fmt: skip
    content = js.choices[0].message.content
    assert content is not None and json.loads(content) in ("yes", "no")


def test_pooling_endpoints(fleet: Fleet) -> None:
    texts = ["the cat sat", "a dog ran"]
    with Producer(fleet.url) as p:
        embedded = p.submit("embed", texts).result(timeout=60)
        ranked = p.submit("ranker", query="the cat", documents=texts).outputs(timeout=60)[0]
        classes = p.submit("sentiment", texts).outputs(timeout=60)
    vectors, tokens = embedded.outputs or [], embedded.usage.prompt_tokens if embedded.usage else 0
    assert tokens > 2 * 3  # the texts' words, [CLS] and [SEP]
    # Embeddings through the openai client, float and base64, are the producer's vectors
    for fmt in ("float", "base64"):
        got = fleet.client.embeddings.create(model="embed", input=texts, encoding_format=fmt)
        assert [d.index for d in got.data] == [0, 1]
        assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
        for d, v in zip(got.data, vectors, strict=True):
            e = d.embedding  # base64 asked for: left as the text (little-endian float32)
            floats = list(array.array("f", base64.b64decode(e))) if isinstance(e, str) else e
            assert floats == pytest.approx(v, rel=1e-5, abs=1e-6)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    # More inputs than a fleet request takes (LangChain sends 1,000) go as several fleet
    # requests, <id>.0, <id>.1, ..., answered as one in the inputs' order
    many = [f"text number {i}" for i in range(150)]
    most = json.loads(fleet.r.get(ModelKeys("embed").limits) or b"{}")["max_inputs"]
    assert most == 32  # the worker published its limit: the model's batch size
    with Producer(fleet.url) as p:
        expected = [v for k in range(0, 150, 30) for v in p.submit("embed", many[k : k + 30])
                    .outputs(timeout=60)]  # fmt: skip
    rid = uuid.uuid4().hex
    got = fleet.client.embeddings.with_raw_response.create(
        model="embed", input=many, extra_headers={"X-Request-Id": rid}
    )
    assert got.headers["x-request-id"] == rid
    embeddings = got.parse()
    assert [d.index for d in embeddings.data] == list(range(150))
    for d, v in zip(embeddings.data, expected, strict=True):
        assert d.embedding == pytest.approx(v, rel=1e-5, abs=1e-6)
    parts = [fleet.r.exists(ModelKeys("embed").result(f"{rid}.{k}")) for k in range(6)]
    assert parts == [1, 1, 1, 1, 1, 0]  # 32, 32, 32, 32 and 22 inputs
    # vLLM's rerank: best first, indices into the documents
    status, body = raw(fleet, "POST", "/v1/rerank", json.dumps(
        {"model": "ranker", "query": "the cat", "documents": texts}).encode(), auth)  # fmt: skip
    assert status == 200
    assert [(x["index"], x["relevance_score"]) for x in body["results"]] == [
        (x["index"], pytest.approx(x["score"])) for x in ranked]  # fmt: skip
    # score 1 → N, in the documents' order
    status, body = raw(fleet, "POST", "/score", json.dumps(
        {"model": "ranker", "text_1": "the cat", "text_2": texts}).encode(), auth)  # fmt: skip
    by_index = {x["index"]: x["score"] for x in ranked}
    assert status == 200 and [d["score"] for d in body["data"]] == [
        pytest.approx(by_index[0]), pytest.approx(by_index[1])]  # fmt: skip
    # classify: labels and probabilities
    status, body = raw(fleet, "POST", "/classify", json.dumps(
        {"model": "sentiment", "input": texts}).encode(), auth)  # fmt: skip
    assert status == 200 and len(body["data"]) == 2
    for d, c in zip(body["data"], classes, strict=True):
        assert d["label"] == c["label"] and sum(d["probs"]) == pytest.approx(1.0, abs=1e-4)
    # the key guards these paths too, and a generation field on an encoder is a 400
    assert raw(fleet, "POST", "/classify", b"{}", {})[0] == 401
    with pytest.raises(openai.BadRequestError):
        fleet.client.chat.completions.create(model="embed", messages=[{"role": "user",
                                             "content": "x"}])  # fmt: skip


def test_a_worker_killed_mid_stream_goes_unseen(
    tmp_path: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    # Given a gateway streaming a long greedy chat from a worker that is kill -9'd part-way
    server = LocalRedis()
    server.start()
    r = redis.Redis.from_url(server.url)
    gateway = None
    try:
        lm = make_causal_lm(tmp_path / "lm", context=4096)
        opts = {"kv_cache_tokens": 8192, "page_size": 16, "step_tokens": 64, "max_running": 16}
        fleet = fleet_toml(server.url, {LM: {"runner": "text-generation", "path": str(lm),
                                             "options": opts}},
                           {"heartbeat_timeout_ms": 1000})  # fmt: skip
        first = start_worker(fleet, "gw-victim")
        first.wait_ready(r, LM)
        gateway, base = start_gateway(server.url, tmp_path)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=LM, messages=[{"role": "user", "content": "there were many"}],
            max_tokens=3000, stream=True, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "killed-1"})  # fmt: skip
        pieces: list[str] = []
        finish = []
        for chunk in stream:
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish.append(c.finish_reason)
            if len(pieces) == 20:
                first.kill()  # When its worker dies, and another takes the request over
                start_worker(fleet, "gw-heir").wait_ready(r, LM)
        # Then the client saw one stream, no error and no repeat: the heir's deltas up to
        # where the first worker stopped were the same (greedy) and skipped
        stored = msgpack.unpackb(r.get(ModelKeys(LM).result("killed-1")))
        (out,) = stored["outputs"]
        assert stored["timings"]["worker"] == "gw-heir"
        assert "".join(pieces) == out["text"] and finish[-1] == out["finish_reason"]
        assert out["completion_tokens"] > 20
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        r.close()
        server.stop()
