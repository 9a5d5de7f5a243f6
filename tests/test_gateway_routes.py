"""vLLM's server routes on the gateway: ``/version``, ``/load``, SageMaker's ``/ping`` and
``/invocations`` (each API's request told apart by its body), and which of them ask for
the API key; the test plays the fleet's workers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis
from batchfleet.schemas.messages import Usage
from batchfleet.schemas.model_info import ModelInfo
from gateway_fakes import ScriptedWorker, gateway_in_process, http

import batchfleet

CHAT = {"model": "mm", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = [{"text": "Hi!", "finish_reason": "stop"}]


def test_version_ping_load_and_which_paths_ask_for_the_key(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "mm")

    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            # /version is batchfleet's
            status, body = await http(port, "GET", "/version", key=None)
            assert (status, json.loads(body)) == (200, {"version": batchfleet.__version__})
            # /ping (GET and POST, SageMaker's), /load and /version need no key (vLLM's
            # PUBLIC_ENDPOINTS); the other routes do
            for method in ("GET", "POST"):
                assert (await http(port, method, "/ping", key=None))[0] == 200
            assert (await http(port, "POST", "/health", key=None))[0] == 405  # as vLLM's
            status, body = await http(port, "GET", "/load", key=None)
            assert (status, json.loads(body)) == (200, {"server_load": 0})
            for method, path in (("POST", "/invocations"), ("GET", "/v1/models"),
                                 ("POST", "/tokenize")):  # fmt: skip
                assert (await http(port, method, path, CHAT, key=None))[0] == 401, path
            # Given two requests to the fleet being answered, and a refused one
            chat = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions", CHAT))
            asked = await asyncio.to_thread(fake.take)
            invoked = asyncio.ensure_future(http(port, "POST", "/invocations", CHAT))
            taken = await asyncio.to_thread(fake.take)
            assert (await http(port, "POST", "/v1/embeddings", {"input": "a"}))[0] == 400
            # Then /load counts the two, and neither once answered
            status, body = await http(port, "GET", "/load", key=None)
            assert json.loads(body) == {"server_load": 2}
            await asyncio.to_thread(fake.ok, asked, ANSWER)
            assert (await chat)[0] == 200
            assert json.loads((await http(port, "GET", "/load"))[1]) == {"server_load": 1}
            await asyncio.to_thread(fake.ok, taken, ANSWER)
            assert (await invoked)[0] == 200
            assert json.loads((await http(port, "GET", "/load"))[1]) == {"server_load": 0}

    try:
        asyncio.run(go())
    finally:
        client.close()


def test_invocations_answers_each_api_by_its_body(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "mm")
    classifier = ScriptedWorker(client, "cls", info=ModelInfo(task="text-classification"))

    async def invoke(body: Any, worker: ScriptedWorker, outputs: list[Any]) -> tuple[Any, Any]:
        """``body`` sent to /invocations, answered with ``outputs``: the request the worker
        read, and the answer (JSON; a stream's events)."""
        ask = asyncio.ensure_future(http(port, "POST", "/invocations", body))
        taken = await asyncio.to_thread(worker.take)
        if body.get("stream"):
            await asyncio.to_thread(worker.delta, taken, 1, "Hi!")
            await asyncio.to_thread(worker.delta, taken, 2)
        await asyncio.to_thread(worker.ok, taken, outputs, Usage(prompt_tokens=3))
        status, raw = await ask
        assert status == 200, raw
        if body.get("stream"):
            return taken.request, [e for e in raw.decode().split("data: ")[1:]]
        return taken.request, json.loads(raw)

    async def go() -> None:
        nonlocal port
        async with gateway_in_process(redis_url) as port:
            # a chat (messages), whole and streamed
            request, answer = await invoke(CHAT, fake, ANSWER)
            assert request.messages[0].content == "hi"
            assert answer["object"] == "chat.completion"
            assert answer["choices"][0]["message"]["content"] == "Hi!"
            request, events = await invoke(CHAT | {"stream": True}, fake, ANSWER)
            assert json.loads(events[0])["object"] == "chat.completion.chunk"
            assert events[-1].strip() == "[DONE]"
            # a completion (prompt)
            request, answer = await invoke({"model": "mm", "prompt": "the cat"}, fake, ANSWER)
            assert request.inputs == ["the cat"] and request.messages is None
            assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == "Hi!"
            # input: an embedding, or the classifier's classification
            request, answer = await invoke({"model": "mm", "input": ["a", "b"]}, fake,
                                           [[1.0], [2.0]])  # fmt: skip
            assert request.inputs == ["a", "b"]
            assert [d["embedding"] for d in answer["data"]] == [[1.0], [2.0]]
            scores = {"label": "pos", "scores": {"neg": 0.25, "pos": 0.75}}
            request, answer = await invoke({"model": "cls", "input": "good"}, classifier,
                                           [scores])  # fmt: skip
            assert request.inputs == ["good"]
            assert answer["data"][0]["label"] == "pos"
            assert answer["data"][0]["probs"] == [0.25, 0.75]
            # a rerank (query, documents), a score (text_1, text_2; queries, documents)
            ranked = [[{"index": 1, "score": 0.75}, {"index": 0, "score": 0.25}]]
            rerank = {"model": "mm", "query": "q", "documents": ["a", "b"]}
            request, answer = await invoke(rerank, fake, ranked)
            ranking = request.inputs[0]
            assert (ranking.query, ranking.documents) == ("q", ["a", "b"])
            assert [r["index"] for r in answer["results"]] == [1, 0]
            for a, b in (("text_1", "text_2"), ("queries", "documents")):
                request, answer = await invoke({"model": "mm", a: "q", b: ["a", "b"]}, fake,
                                               ranked)  # fmt: skip
                ranking = request.inputs[0]
                assert (ranking.query, ranking.documents) == ("q", ["a", "b"])
                assert [d["score"] for d in answer["data"]] == [0.25, 0.75]
            # Then a body of none of them, or not an object, is a 400 naming what it takes
            for bad, param in (({"model": "mm"}, "messages"), ({"query": "q"}, "messages"),
                               ([1], None), ("{", None)):  # fmt: skip
                status, raw = await http(port, "POST", "/invocations", bad)
                error = json.loads(raw)["error"]
                assert (status, error["param"]) == (400, param), raw
            # and a chosen API's own checks apply
            status, raw = await http(port, "POST", "/invocations", {"model": "mm", "input": 3})
            assert (status, json.loads(raw)["error"]["param"]) == (400, "input")
            status, raw = await http(port, "POST", "/invocations", CHAT | {"model": "none"})
            assert (status, json.loads(raw)["error"]["code"]) == (404, "model_not_found")

    port = 0
    try:
        asyncio.run(go())
    finally:
        client.close()


def test_pooling_requests_to_a_generating_model_are_refused_before_submitting(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    generator = ScriptedWorker(client, "gen", info=ModelInfo(task="text-generation",
                                                             chat_template=False))  # fmt: skip
    embedder = ScriptedWorker(client, "emb", info=ModelInfo(task="embedding"))

    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            # Given a model whose workers publish a generator's info (a worker would take an
            # embedding's texts as prompts, and generate for each before it was refused)
            for path, body in (("/v1/embeddings", {"input": ["a", "b"]}),
                               ("/invocations", {"input": "a"}), ("/pooling", {"input": "a"}),
                               ("/classify", {"input": "a"}),
                               ("/score", {"text_1": "a", "text_2": "b"}),
                               ("/rerank", {"query": "q", "documents": ["a"]})):  # fmt: skip
                # When a pooling request names it, Then it is a 400 at once
                status, raw = await http(port, "POST", path, body | {"model": "gen"})
                error = json.loads(raw)["error"]
                assert (status, error["param"]) == (400, "model"), (path, raw)
                assert "generates text" in error["message"]
            # and nothing was submitted: the next request its worker reads is a chat
            chat = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions",
                                              CHAT | {"model": "gen"}))  # fmt: skip
            taken = await asyncio.to_thread(generator.take)
            assert taken.request.messages is not None
            await asyncio.to_thread(generator.ok, taken, ANSWER)
            assert (await chat)[0] == 200
            # an encoder's are asked as before
            asked = asyncio.ensure_future(http(port, "POST", "/invocations",
                                               {"model": "emb", "input": "a"}))  # fmt: skip
            taken = await asyncio.to_thread(embedder.take)
            await asyncio.to_thread(embedder.ok, taken, [[1.0, 0.0]])
            status, raw = await asked
            assert status == 200 and json.loads(raw)["data"][0]["embedding"] == [1.0, 0.0]

    try:
        asyncio.run(go())
    finally:
        client.close()
