"""Text generation end to end: the producers against a real `text-generation` worker process
(tiny random Llamas), streaming, cancelling, a worker killed or stalled mid-generation, and a
generation longer than ``claim_idle_ms`` left with its live worker."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.producer import AsyncProducer, Producer
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.messages import Delta, TokenLogprob
from conftest import TINY_LM_OPTIONS, WorkerProcess, fleet_toml
from tiny_models import make_causal_lm

from batchfleet import cli

pytestmark = pytest.mark.timeout(240)

CHAT = [{"role": "user", "content": "the man was"}]


def gen_fleet(redis_url: str, lm: Path, **worker: object) -> str:
    spec = {"runner": "text-generation", "path": str(lm), "options": TINY_LM_OPTIONS}
    return fleet_toml(redis_url, {"gen": spec}, worker)


def test_stream_gives_the_result_text_and_cancel_stops_it(
    redis_url: str, r: redis.Redis, tiny_lm: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    start_worker(gen_fleet(redis_url, tiny_lm), "gen-1").wait_ready(r, "gen")
    with Producer(redis_url) as producer:
        # a chat, streamed: the pieces are the result's text
        job = producer.submit("gen", messages=CHAT, max_new_tokens=16, stream=True)
        streamed = "".join(job.stream(timeout=60))
        (generation,) = job.result().generations()
        assert streamed == generation.text == job.text() and generation.completion_tokens > 0
        assert generation.finish_reason in ("stop", "length")

        # two inputs: deltas() tells them apart; each carries its tokens' log-probabilities
        two = producer.submit("gen", ["a b c", "there were many"], max_new_tokens=8, stream=True,
                              logprobs=2)  # fmt: skip
        texts = ["", ""]
        lps: list[list[TokenLogprob]] = [[], []]
        prompts: list[list[int | None]] = [[], []]
        for delta in two.deltas(timeout=60):
            assert isinstance(delta, Delta) and delta.logprobs is not None
            assert len(delta.logprobs) == delta.tokens
            texts[delta.input] += delta.text
            lps[delta.input] += delta.logprobs
            prompts[delta.input].append(delta.prompt_tokens)
        outs = two.result().generations()
        assert texts == [g.text for g in outs]
        # each output's first delta tells its prompt's tokens, the others nothing
        assert [p[0] for p in prompts] == [g.prompt_tokens for g in outs]
        assert all(x is None for p in prompts for x in p[1:])
        assert all(o.logprobs is not None and o.logprobs[: len(lp)] == lp
                   for o, lp in zip(outs, lps, strict=True))  # fmt: skip

        # cancelled once it has started: the text so far, finish_reason cancelled
        long = producer.submit("gen", "a b c", max_new_tokens=900, stream=True)
        pieces = long.stream(timeout=60)
        first = next(pieces)
        producer.cancel(long)
        rest = "".join(pieces)
        (cancelled,) = long.result().generations()
        assert cancelled.finish_reason == "cancelled" and cancelled.text == first + rest
        assert 0 < cancelled.completion_tokens < 900

        # from the shell: a chat, streamed, with other fields as JSON (a regex here)
        out = io.StringIO()
        argv = ["submit", "gen", "the", "man", "--chat", "--stream", "--max-new-tokens", "12",
                "--options", '{"structured_outputs": {"regex": "[0-9]{3}"}}',
                "--redis-url", redis_url, "--timeout", "60"]  # fmt: skip
        with contextlib.redirect_stdout(out):
            assert cli.main(argv) == 0
        streamed, _, printed = out.getvalue().partition("\n")
        (shell,) = json.loads(printed)["outputs"]
        assert re.fullmatch("[0-9]{3}", streamed) and shell["text"] == streamed
        assert shell["finish_reason"] == "stop"

        # cancelled before it is submitted: stopped within a poll of the cancel keys
        producer.cancel("early", model="gen")
        early = producer.submit("gen", "it", request_id="early", max_new_tokens=900, stream=True)
        streamed = "".join(early.stream(timeout=60))
        (stopped,) = early.result().generations()
        assert (stopped.text, stopped.finish_reason) == (streamed, "cancelled")


def test_async_stream_and_cancel(
    redis_url: str, r: redis.Redis, tiny_lm: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    start_worker(gen_fleet(redis_url, tiny_lm), "gen-async").wait_ready(r, "gen")

    async def go() -> None:
        async with AsyncProducer(redis_url) as producer:
            job = await producer.submit("gen", messages=CHAT, max_new_tokens=12, stream=True)
            streamed = "".join([piece async for piece in job.stream(timeout=60)])
            assert streamed == await job.text()

            long = await producer.submit("gen", "a b c", max_new_tokens=900, stream=True)
            pieces = long.stream(timeout=60)
            first = await anext(pieces)
            await long.cancel()
            rest = "".join([piece async for piece in pieces])
            (cancelled,) = (await long.result()).generations()
            assert cancelled.finish_reason == "cancelled" and cancelled.text == first + rest

    asyncio.run(go())


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_worker_lost_mid_generation_is_followed_to_one_result(
    fault: str,
    redis_url: str,
    r: redis.Redis,
    tiny_lm: Path,
    start_worker: Callable[..., WorkerProcess],
) -> None:
    # Given a worker generating a long streamed answer (greedy) that is killed part-way, or
    # stalls (SIGSTOP: a long GC or VM pause) past the heartbeat timeout
    fleet = gen_fleet(redis_url, tiny_lm, heartbeat_timeout_ms=1000)
    first = start_worker(fleet, f"gen-{fault}")
    first.wait_ready(r, "gen")
    pid = first.process.pid
    with Producer(redis_url) as producer:
        job = producer.submit("gen", "there were many", max_new_tokens=2000, stream=True)
        deltas = job.deltas(timeout=120)
        seen = [next(deltas) for _ in range(3)]
        os.kill(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        try:
            # When another worker takes the request over and generates it again (and the
            # stalled one resumes once the heir has streamed)
            start_worker(fleet, "gen-heir").wait_ready(r, "gen")
            rest: list[Delta | Restarted] = []
            for d in deltas:
                rest.append(d)
                if isinstance(d, Restarted) and fault == "stalled":
                    time.sleep(0.3)
                    os.kill(pid, signal.SIGCONT)
        finally:
            if fault == "stalled":
                os.kill(pid, signal.SIGCONT)
        result = job.result()

    # Then the reader saw one restart, then the heir's whole text from seq 1 and nothing
    # else (a stalled worker's later deltas are refused by the token stream), and the
    # heir's result; a stalled worker dropped the request
    marks = [i for i, d in enumerate(rest) if isinstance(d, Restarted)]
    assert len(marks) == 1, marks
    again = [d for d in rest[marks[0] + 1 :] if isinstance(d, Delta)]
    assert [d.seq for d in again] == list(range(1, len(again) + 1))
    (generation,) = result.generations()
    assert "".join(d.text for d in again) == generation.text
    assert all(isinstance(d, Delta) for d in seen)
    assert generation.text.startswith("".join(d.text for d in seen if isinstance(d, Delta)))
    assert result.timings.worker == "gen-heir"
    if fault == "stalled":
        assert "taken over by other workers" in first.log.read_text()


def test_a_generation_longer_than_claim_idle_ms_stays_with_its_live_worker(
    redis_url: str,
    r: redis.Redis,
    tmp_path_factory: pytest.TempPathFactory,
    start_worker: Callable[..., WorkerProcess],
) -> None:
    # Given two workers of a model whose answer can run to 4000 tokens (seconds of steps),
    # the idle-time fallback at 400 ms
    lm = make_causal_lm(tmp_path_factory.mktemp("long-lm"), layers=4, hidden=128, context=4096)
    options = TINY_LM_OPTIONS | {"kv_cache_tokens": 4096}
    spec = {"runner": "text-generation", "path": str(lm), "options": options}
    fleet = fleet_toml(redis_url, {"gen": spec}, {"claim_idle_ms": 400})
    names = ("gen-a", "gen-b")
    for name in names:
        start_worker(fleet, name).wait_ready(r, "gen")
    with Producer(redis_url) as producer:
        # When one of them generates for several times claim_idle_ms (the test decides how
        # long: it cancels the answer after 2 s of it, so a fast machine cannot end it sooner)
        started = time.monotonic()
        job = producer.submit("gen", "there were many", max_new_tokens=4000, stream=True,
                              ignore_eos=True)  # fmt: skip
        deltas, cancelled = [], False
        for delta in job.deltas(timeout=120):
            deltas.append(delta)
            if not cancelled and time.monotonic() - started > 5 * 0.4:
                job.cancel()
                cancelled = True
        # Then it was generated once, by the worker that read it: never taken, no restart
        restarts = [d for d in deltas if isinstance(d, Restarted)]
        assert restarts == [], "taken from its live worker and generated again"
        result = job.result()
        assert result.ok and result.timings.worker in names
        (generation,) = result.generations()
        assert generation.finish_reason == "cancelled", "the answer ended before 2 s: too short"


def test_the_prompt_alone_its_text_and_stop_reasons_through_a_worker(
    redis_url: str, r: redis.Redis, tiny_lm: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_lm)
    start_worker(gen_fleet(redis_url, tiny_lm), "gen-prompt").wait_ready(r, "gen")
    texts = ["the man was", "a b c"]
    with Producer(redis_url) as producer:
        # a tokenizer's count: max_new_tokens 0, two inputs, two completions each
        job = producer.submit("gen", inputs=texts, max_new_tokens=0, n=2, return_token_ids=True,
                              return_prompt_text=True)  # fmt: skip
        result = job.result(timeout=60)
        outs = result.generations()
        assert len(outs) == 4 and result.usage is not None
        assert result.usage.completion_tokens == 0
        assert result.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in texts)
        for i, text in enumerate(texts):
            first, second = outs[2 * i], outs[2 * i + 1]
            assert (first.prompt_token_ids, first.prompt_text) == (tok(text).input_ids, text)
            assert second.prompt_token_ids is None and second.prompt_text is None
            for g in (first, second):
                assert (g.text, g.finish_reason, g.completion_tokens) == ("", "length", 0)
                assert g.token_ids == [] and g.stop_reason is None
        # streamed: no delta, and the stream ends
        streamed = producer.submit("gen", "the man was", max_new_tokens=0, stream=True)
        assert list(streamed.deltas(timeout=60)) == [] and streamed.text() == ""
        # a chat: its template as rendered
        chat = producer.submit("gen", messages=CHAT, max_new_tokens=0, return_prompt_text=True)
        (said,) = chat.result(timeout=60).generations()
        assert said.prompt_text == tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                                           tokenize=False)  # fmt: skip
        # stop_reason: the stop string, or the stop token, that ended the text
        rules: dict[str, Any] = {"max_new_tokens": 12, "repetition_penalty": 3.0}
        plain = producer.submit("gen", "a b c", return_token_ids=True, **rules)
        (whole,) = plain.result(timeout=60).generations()
        assert whole.finish_reason == "length" and whole.stop_reason is None
        assert whole.token_ids is not None and whole.token_ids[1] not in whole.token_ids[:1]
        stop = whole.text[5:7]
        assert stop.strip(), whole.text
        by_string = producer.submit("gen", "a b c", stop=["§", stop], **rules)
        (cut,) = by_string.result(timeout=60).generations()
        assert (cut.finish_reason, cut.stop_reason, cut.text) == (
            "stop", stop, whole.text[: whole.text.index(stop)])  # fmt: skip
        by_token = producer.submit("gen", "a b c", stop_token_ids=[whole.token_ids[1]], **rules)
        (ended,) = by_token.result(timeout=60).generations()
        assert (ended.finish_reason, ended.stop_reason, ended.completion_tokens) == (
            "stop", whole.token_ids[1], 2)  # fmt: skip

    async def scored() -> None:  # the async producer takes the same options
        async with AsyncProducer(redis_url) as producer:
            job = await producer.submit("gen", inputs=texts[:1], max_new_tokens=0,
                                        return_prompt_text=True)  # fmt: skip
            (g,) = (await job.result(timeout=60)).generations()
            assert (g.prompt_text, g.completion_tokens) == (texts[0], 0)

    asyncio.run(scored())
