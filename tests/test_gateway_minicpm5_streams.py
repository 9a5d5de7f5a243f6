"""``minicpm5``'s content through every path of the gateway and the producer: its result's
``content`` is what follows the last ``</think>``, while its stream's keeps the thinking,
as vLLM's does. Whatever streams shows what the deltas carried (live, several outputs,
with usage, read again from the token stream when the stream joins late or its
subscription was lost, rebuilt for a background response, by the producer's helpers);
whatever answers whole shows the result's (the chat and Responses answers, the final
response of a stream, run-batch's lines).

A tiny model's runner with the ``minicpm5`` tool parser is given each output's text a token
a step (a real request, as the gateway submitted it); its deltas and result are written
to a real Redis as its worker writes them."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from devices import DEVICE

pytest.importorskip("torch")

from batchfleet.producer.aio import AsyncJob, AsyncProducer
from batchfleet.producer.gateway import direct
from batchfleet.producer.gateway.chunks import Chunks
from batchfleet.producer.gateway.endpoint import Answered
from batchfleet.producer.gateway.replies import Replies
from batchfleet.producer.gateway.state import Gateway
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.codec import decode_entry, encode_result
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Delta, Request, Result, Usage
from batchfleet.worker.deltas import StreamTo
from batchfleet.worker.runner import Final, Partial
from batchfleet.worker.runners.generation import TextGenerationRunner
from batchfleet.worker.streams import ModelStreams
from batchfleet.worker.token_stream import TokenWrite
from conftest import TINY_LM_OPTIONS
from gateway_fakes import ScriptedWorker, Taken, gateway_in_process, http
from test_generation_tools import TOOLS

pytestmark = pytest.mark.timeout(120)
MODEL = "mm"
KEYS = ModelKeys(MODEL)
TEXTS = ["<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.", "Hm.</think>It rains."]
"""Each output's text: its stream's content, the thinking kept."""
SHOWN = ["It is sunny.", "It rains."]
"""Each output's result's content: what follows its last ``</think>``."""
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the weather?"}],
        "tools": TOOLS}  # fmt: skip
RESPONSE = {"model": MODEL, "input": "the weather?", "stream": True,
            "tools": [{"type": "function", "name": "get_weather",
                       "parameters": TOOLS[0]["function"]["parameters"]}]}  # fmt: skip


@pytest.fixture(scope="module")
def runner(tiny_lm: Path) -> TextGenerationRunner:
    return TextGenerationRunner(tiny_lm, device=DEVICE, dtype="float32",
                                options={**TINY_LM_OPTIONS, "tool_call_parser": "minicpm5"})  # fmt: skip


@dataclass
class Made:
    """A request's deltas (the runner's chunks) and its result's outputs."""

    chunks: list[dict[str, Any]]
    outputs: list[dict[str, Any]]

    def result(self, rid: str) -> Result:
        usage = Usage(prompt_tokens=self.outputs[0]["prompt_tokens"],
                      completion_tokens=sum(o["completion_tokens"] for o in self.outputs))  # fmt: skip
        return Result(id=rid, model=MODEL, status="ok", outputs=self.outputs, usage=usage)

    def writes(self, rid: str, reply: str | None, published: int | None = None) -> list[TokenWrite]:
        """The token stream's entries, its end last; only the first ``published`` deltas'
        messages published (None: all)."""
        out = []
        for seq, chunk in enumerate(self.chunks, 1):
            told = reply if published is None or seq <= published else None
            out.append(StreamTo(rid, rid, MODEL, 60, told, "msgpack").delta(seq, chunk).write())
        return [*out, TokenWrite(rid, len(self.chunks) + 1, 60)]


def forced(runner: TextGenerationRunner, request: Request, texts: list[str]) -> Made:
    """``request`` admitted as a step admits it, each output given its text a token a step."""
    key = request.id
    (prep,) = runner.prepare_many([request])
    runner._admit(key, prep, 1)
    r = runner._reqs[key]
    ids = [runner.tokenizer(t)["input_ids"] for t in texts]
    chunks: list[dict[str, Any]] = []
    for k in range(max(map(len, ids))):
        for seq, tokens in zip(r.seqs, ids, strict=True):
            seq.text.extend(tokens[k : k + 1])
        chunks += [ev.chunk for ev in runner._deltas(r) if isinstance(ev, Partial)]
    *tail, final = runner._finish(r)
    chunks += [ev.chunk for ev in tail if isinstance(ev, Partial)]
    assert isinstance(final, Final)
    outputs = final.outputs
    assert [o["content"] for o in outputs] == SHOWN[: len(texts)]  # as vLLM's whole read
    return Made(chunks if request.stream else [], outputs)


def play(fake: ScriptedWorker, runner: TextGenerationRunner, taken: Taken) -> Made:
    """The worker's side of a request the gateway submitted: its deltas, then its result."""
    request, _ = decode_entry(taken.entry.fields, MODEL)
    made = forced(runner, request, TEXTS[: request.output_count])
    if made.chunks:
        fake.streams.append_tokens(made.writes(taken.id, taken.reply))
    fake.answer(taken, made.result(taken.id))
    return made


def events(raw: bytes) -> list[dict[str, Any]]:
    """A stream's events (chunks or named events), in order, ``[DONE]`` left out."""
    lines = raw.decode().splitlines()
    return [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]


def streamed_text(got: list[dict[str, Any]]) -> str:
    """A Responses API stream's message text: its deltas' sum, the same as each of its
    ``done`` events says."""
    deltas = [e["delta"] for e in got if e["type"] == "response.output_text.delta"]
    (done,) = [e for e in got if e["type"] == "response.output_text.done"]
    (part,) = [e for e in got if e["type"] == "response.content_part.done"]
    (item,) = [e for e in got if e["type"] == "response.output_item.done"]
    text = "".join(deltas)
    assert done["text"] == part["part"]["text"] == item["item"]["content"][0]["text"] == text
    return text


def chat_contents(chunks: list[dict[str, Any]]) -> dict[int, str]:
    """Each choice's streamed ``content``."""
    out: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            out[choice["index"]] = out.get(choice["index"], "") + (
                choice.get("delta", {}).get("content") or "")  # fmt: skip
    return out


async def asked(port: int, fake: ScriptedWorker, runner: TextGenerationRunner, path: str,
                body: dict[str, Any]) -> tuple[bytes, Taken]:  # fmt: skip
    """``body`` sent to ``path`` and answered by the worker: the answer's body."""
    sent = asyncio.ensure_future(http(port, "POST", path, body))
    taken = await asyncio.to_thread(fake.take)
    await asyncio.to_thread(play, fake, runner, taken)
    status, raw = await sent
    assert status == 200, raw
    return raw, taken


@pytest.fixture
def fake(r: redis.Redis) -> ScriptedWorker:
    return ScriptedWorker(r, MODEL)


def test_chat_streams_show_the_thinking_their_whole_answers_leave_out(
    redis_url: str, fake: ScriptedWorker, runner: TextGenerationRunner
) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            # streamed, two completions, the usage asked: each choice's content is its
            # deltas' (the thinking kept); its last chunks add none, the usage the result's
            body = CHAT | {"n": 2, "stream": True, "stream_options": {"include_usage": True}}
            raw, taken = await asked(port, fake, runner, "/v1/chat/completions", body)
            assert taken.request.n == 2 and taken.request.tools is not None
            chunks = events(raw)
            assert chat_contents(chunks) == dict(enumerate(TEXTS))
            ends = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert [e["choices"][0]["delta"] for e in ends] == [{}, {}]
            assert chunks[-1]["usage"]["completion_tokens"] > 0
            # whole, the result's content (vLLM's whole read strips the thinking)
            raw, _ = await asked(port, fake, runner, "/v1/chat/completions", CHAT | {"n": 2})
            answer = json.loads(raw)
            assert [c["message"]["content"] for c in answer["choices"]] == SHOWN

    asyncio.run(go())


def test_responses_and_messages_streams_show_the_deltas_and_store_the_result(
    redis_url: str, fake: ScriptedWorker, runner: TextGenerationRunner
) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            # the Responses API: the deltas, and each text's done events, are what was
            # streamed; the final response (and the one stored) the result's, as vLLM's
            raw, _ = await asked(port, fake, runner, "/v1/responses", RESPONSE)
            got = events(raw)
            assert streamed_text(got) == TEXTS[0]
            final = got[-1]["response"]
            assert got[-1]["type"] == "response.completed"
            assert [o["content"][0]["text"] for o in final["output"]] == [SHOWN[0]]
            status, stored = await http(port, "GET", f"/v1/responses/{final['id']}")
            assert status == 200 and json.loads(stored)["output"] == final["output"]
            # whole: the result's
            raw, _ = await asked(port, fake, runner, "/v1/responses", RESPONSE | {"stream": False})
            assert json.loads(raw)["output"][0]["content"][0]["text"] == SHOWN[0]
            # Anthropic's Messages API: the text deltas are the deltas' content
            messages = {"model": MODEL, "max_tokens": 64, "stream": True,
                        "messages": CHAT["messages"],
                        "tools": [{"name": "get_weather",
                                   "input_schema": TOOLS[0]["function"]["parameters"]}]}  # fmt: skip
            raw, _ = await asked(port, fake, runner, "/v1/messages", messages)
            texts = [e["delta"]["text"] for e in events(raw)
                     if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"]  # fmt: skip
            assert "".join(texts) == TEXTS[0]
            raw, _ = await asked(port, fake, runner, "/v1/messages", messages | {"stream": False})
            assert [b["text"] for b in json.loads(raw)["content"]] == [SHOWN[0]]

    asyncio.run(go())


def test_a_background_response_s_stream_and_its_resumption_show_the_deltas(
    redis_url: str, fake: ScriptedWorker, runner: TextGenerationRunner
) -> None:
    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            background = RESPONSE | {"background": True}
            raw, _ = await asked(port, fake, runner, "/v1/responses", background)
            first = events(raw)
            rid = first[0]["response"]["id"]
            # resumed after its first three events: rebuilt from what Redis holds
            status, again = await http(
                port, "GET", f"/v1/responses/{rid}?stream=true&starting_after=2"
            )
            assert status == 200
            assert events(again) == first[3:]
            assert streamed_text(first) == streamed_text(events(again)) == TEXTS[0]
            assert first[-1]["response"]["output"][0]["content"][0]["text"] == SHOWN[0]

    asyncio.run(go())


async def streamed(replies: Replies, job: AsyncJob, chunks: Chunks,
                   seen: list[Any] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``job``'s chunks as the chat route makes them of its events (each put in ``seen``)."""
    out: list[dict[str, Any]] = []
    async for event in replies.events(job, 10):
        (seen if seen is not None else []).append(event)
        out += chunks.finish(event) if isinstance(event, Result) else chunks.feed(event)
    return out


def test_a_stream_read_again_from_its_token_stream_shows_the_deltas(
    redis_url: str, r: redis.Redis, runner: TextGenerationRunner
) -> None:
    body = CHAT | {"n": 2, "stream": True}
    streams = ModelStreams(r, MODEL, 3, "w1")

    def made(rid: str) -> Made:
        return forced(runner, Request(id=rid, model=MODEL, messages=CHAT["messages"],
                                      tools=TOOLS, n=2, stream=True), TEXTS)  # fmt: skip

    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            replies = Replies(p)
            replies.start()
            await replies.subscribed.wait()
            # a stream that joins once its result is stored: all from the token stream
            late = made("late")
            streams.append_tokens(late.writes("late", None))
            r.set(KEYS.result("late"), encode_result(late.result("late")))
            job = AsyncJob("late", MODEL, producer=p, streaming=True, output_count=2)
            seen: list[Any] = []
            with replies.stream(MODEL, "late"):
                maker = Chunks(body, Answered("c-1", 1), MODEL, True)
                chunks = await streamed(replies, job, maker, seen)
            assert isinstance(seen[0], Restarted)
            assert chat_contents(chunks) == dict(enumerate(TEXTS))
            # the subscription lost after 5 deltas: the rest read from the token stream,
            # what was sent skipped
            cut = made("cut")
            writes = cut.writes("cut", p.reply_channel, published=5)
            job = AsyncJob("cut", MODEL, producer=p, streaming=True, output_count=2)
            seen.clear()
            with replies.stream(MODEL, "cut"):
                maker = Chunks(body, Answered("c-2", 1), MODEL, True)
                reading = asyncio.ensure_future(streamed(replies, job, maker, seen))
                await asyncio.sleep(0.05)
                streams.append_tokens(writes[:5])
                while len(seen) < 5:  # the five read (and their chunks sent)
                    await asyncio.sleep(0.01)
                r.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                streams.append_tokens(writes[5:])
                r.set(KEYS.result("cut"), encode_result(cut.result("cut")))
                chunks = await asyncio.wait_for(reading, 20)
            assert chat_contents(chunks) == dict(enumerate(TEXTS))
            assert any(isinstance(e, Restarted) for e in seen[5:])  # read again from the start
            await replies.close()

    asyncio.run(go())


def test_the_producer_s_helpers_and_run_batch(
    redis_url: str, r: redis.Redis, fake: ScriptedWorker, runner: TextGenerationRunner
) -> None:
    async def go() -> None:
        async with AsyncProducer(redis_url) as p:
            # job.stream() and job.deltas() read the token stream: the deltas' content;
            # job.result() the result's
            one = forced(runner, Request(id="one", model=MODEL, messages=CHAT["messages"],
                                         tools=TOOLS, stream=True), TEXTS[:1])  # fmt: skip
            ModelStreams(r, MODEL, 3, "w1").append_tokens(one.writes("one", None))
            r.set(KEYS.result("one"), encode_result(one.result("one")))
            job = AsyncJob("one", MODEL, producer=p, streaming=True)
            assert "".join([piece async for piece in job.stream(5, "content")]) == TEXTS[0]
            assert "".join([piece async for piece in job.stream(5)]) == TEXTS[0]
            deltas = [d async for d in job.deltas(5)]
            assert "".join(d.content or "" for d in deltas if isinstance(d, Delta)) == TEXTS[0]
            assert (await job.result(5)).generations()[0].content == SHOWN[0]
            # run-batch answers each line whole: the result's content
            gateway = Gateway(p, timeout_s=20)
            gateway.replies.start()
            await gateway.replies.subscribed.wait()
            line = asyncio.ensure_future(direct.answer(gateway, "/v1/chat/completions",
                                                       CHAT | {"n": 2}))  # fmt: skip
            await asyncio.to_thread(play, fake, runner, await asyncio.to_thread(fake.take))
            outcome = await line
            assert outcome.status == 200, outcome
            assert outcome.body is not None
            assert [c["message"]["content"] for c in outcome.body["choices"]] == SHOWN
            await gateway.replies.close()

    asyncio.run(go())
