"""Background responses that show their progress: ``in_progress`` once the fleet began,
streamed (``background`` with ``stream``: each event numbered) and resumed after the last
event read (``GET /v1/responses/{id}?stream=true&starting_after=N``) on any gateway, a
client that leaves cancelling nothing, a cancel ending every stream. The gateway in-process
against a real Redis, the test playing the worker (so each token comes on cue)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import openai
import pydantic
import pytest
import redis
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import ModelKeys, response_key
from batchfleet.schemas.messages import ErrorInfo, Result, Usage
from gateway_fakes import GATEWAY_KEY, ScriptedWorker, Taken, gateway_in_process, http, http_request
from openai.types.responses import ResponseStreamEvent
from test_gateway_responses_background import ASK, call, get
from test_gateway_responses_store import MODEL, answered, run

pytestmark = pytest.mark.timeout(120)

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
STREAMED = ASK | {"stream": True}
Event = dict[str, Any]


async def opened(port: int, method: str, path: str, body: Any = None) -> asyncio.StreamReader:
    """An event stream from the gateway, its head read (200, server-sent events)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_request(method, path, body))
    head = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"text/event-stream" in head, head
    reader.writer = writer  # type: ignore[attr-defined]  # to close it with
    return reader


async def read(reader: asyncio.StreamReader, until: Callable[[Event], bool] | None = None
               ) -> list[Event]:  # fmt: skip
    """Events up to the first ``until`` holds for (None: to the stream's end), each checked
    against the openai client's own types."""
    events: list[Event] = []
    while not events or until is None or not until(events[-1]):
        try:
            raw = await reader.readuntil(b"\n\n")
        except asyncio.IncompleteReadError as end:
            assert until is None and not end.partial, end.partial
            return events
        kind, data = raw.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENT.validate_python(event)
        events.append(event)
    return events


def leave(reader: asyncio.StreamReader) -> None:
    reader.writer.close()  # type: ignore[attr-defined]


async def seen_leaving(port: int) -> None:
    """Until the gateway saw a client of ``POST /v1/responses`` leave (its metrics' 499)."""
    for _ in range(500):
        _, raw = await http(port, "GET", "/metrics")
        if any(line.startswith("batchfleet_gateway_requests_total{") and 'status="499"' in line
               and 'route="/v1/responses"' in line for line in raw.decode().splitlines()):  # fmt: skip
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the gateway never saw the client leave")


def texts(events: list[Event]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def delta_is(text: str) -> Callable[[Event], bool]:
    return lambda e: e["type"] == "response.output_text.delta" and e["delta"] == text


async def worker(fake: ScriptedWorker, taken: Taken, *pieces: str | None, first: int = 1) -> None:
    """The worker writes these token-stream entries (None: the end), in order, the first
    numbered ``first``."""
    for seq, piece in enumerate(pieces, first):
        await asyncio.to_thread(fake.delta, taken, seq, piece)


def test_a_background_response_is_in_progress_once_its_worker_began(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a background response a worker took, but began no token of
        _, first = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        assert taken.request.stream  # submitted streamed: its token stream tells
        assert await get(port, first["id"]) == first
        # When the worker generates its first token (no text yet)
        await worker(fake, taken, "")
        # Then every gateway answers it in_progress
        assert await get(port, first["id"]) == first | {"status": "in_progress"}
        async with gateway_in_process(redis_url) as other:
            assert (await get(other, first["id"]))["status"] == "in_progress"
        # without writing it so (a cancel may be under way)
        record = json.loads(r.get(response_key(first["id"])) or b"")
        assert record["response"]["status"] == "queued"
        # and once the result is in, it is final
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
        assert (await get(port, first["id"]))["status"] == "completed"
        # and a cancelled one stays cancelled while the worker goes on
        _, other_ = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        assert (await call(port, "POST", f"/v1/responses/{other_['id']}/cancel"))[0] == 200
        await worker(fake, taken, "H")
        assert (await get(port, other_["id"]))["status"] == "cancelled"

    run(redis_url, scenario)


def test_a_background_response_is_in_progress_once_a_worker_admits_it_before_any_token(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a background response, polled, and one streamed, both taken by a worker
        # that holds them waiting for a free slot (a long prompt ahead of them)
        _, polled = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        stream = await opened(port, "POST", "/v1/responses", STREAMED)
        seen = await read(stream, lambda e: e["type"] == "response.queued")
        streamed = await asyncio.to_thread(fake.take)
        assert await get(port, polled["id"]) == polled  # taken is not started: queued
        # When the worker admits them: their prompts are read, no token yet
        await asyncio.to_thread(fake.start, taken)
        await asyncio.to_thread(fake.start, streamed)
        assert not r.exists(ModelKeys(MODEL).tokens(taken.id), ModelKeys(MODEL).tokens(streamed.id))
        # Then every gateway answers the polled one in_progress
        assert await get(port, polled["id"]) == polled | {"status": "in_progress"}
        async with gateway_in_process(redis_url) as other:
            assert (await get(other, polled["id"]))["status"] == "in_progress"
        # and the streamed one says so, before any output
        seen += await read(stream, lambda e: e["type"] == "response.in_progress")
        created = seen[0]["response"]
        assert [e["type"] for e in seen] == ["response.created", "response.queued",
                                             "response.in_progress"]  # fmt: skip
        assert seen[-1]["response"] == created | {"status": "in_progress"}
        # and its first token opens the output, in_progress not said again
        await worker(fake, streamed, "Hi")
        seen += await read(stream, delta_is("Hi"))
        assert [e["type"] for e in seen[3:]] == [
            "response.output_item.added", "response.content_part.added",
            "response.output_text.delta"]  # fmt: skip
        await asyncio.to_thread(fake.ok, streamed, [{"text": "Hi", "finish_reason": "stop"}])
        await worker(fake, streamed, None, first=2)
        seen += await read(stream)
        # and its events rebuilt from the start are the same, under the same numbers
        path = f"/v1/responses/{created['id']}?stream=true"
        assert await read(await opened(port, "GET", path)) == seen
        assert [e["sequence_number"] for e in seen] == list(range(len(seen)))

    run(redis_url, scenario)


def test_a_background_response_whose_worker_died_is_queued_again(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a background response admitted by a worker: in_progress
        _, polled = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.start, taken)
        assert (await get(port, polled["id"]))["status"] == "in_progress"
        # When the worker dies (its heartbeat stops; no worker took its request over yet)
        await asyncio.to_thread(fake.beat, 60_000)
        # Then the response is queued again, on every gateway (its started key stands)
        assert await get(port, polled["id"]) == polled
        assert r.get(ModelKeys(MODEL).started(taken.id)) == b"w1"
        # and in progress again once a live worker admits it
        heir = ScriptedWorker(r, MODEL)
        heir.streams.consumer = "w2"
        await asyncio.to_thread(heir.start, taken)
        assert (await get(port, polled["id"]))["status"] == "in_progress"

    run(redis_url, scenario)


def test_a_streamed_background_response_resumes_on_another_gateway(
    redis_url: str, r: redis.Redis
) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a background response streamed: created and queued at once
        stream = await opened(port, "POST", "/v1/responses", STREAMED)
        opening = await read(stream, lambda e: e["type"] == "response.queued")
        assert [e["type"] for e in opening] == ["response.created", "response.queued"]
        created = opening[0]["response"]
        assert created["status"] == "queued" and created["background"] and created["store"]
        assert r.exists(response_key(created["id"]))  # stored before its first event
        taken = await asyncio.to_thread(fake.take)
        assert created["id"] == f"resp_{taken.id}"
        # When the worker writes its first token (no text yet): in progress
        await worker(fake, taken, "")
        seen = opening + await read(stream, lambda e: e["type"] == "response.in_progress")
        assert len(seen) == 3 and seen[-1]["response"] == created | {"status": "in_progress"}
        # and its next ones, read as they come
        await worker(fake, taken, "Hel", "lo", first=2)
        seen += await read(stream, delta_is("lo"))
        assert [e["type"] for e in seen[3:5]] == ["response.output_item.added",
                                                  "response.content_part.added"]  # fmt: skip
        # and the client leaves (while the worker is quiet), and the worker ends it
        leave(stream)
        await seen_leaving(port)
        await asyncio.to_thread(fake.delta, taken, 4, " world")
        usage = Usage(prompt_tokens=4, completion_tokens=4)
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hello world", "finish_reason": "stop"}],
                                usage)  # fmt: skip
        await asyncio.to_thread(fake.delta, taken, 5, None)
        # Then another gateway streams the rest, after the last event read
        last = seen[-1]["sequence_number"]
        async with gateway_in_process(redis_url) as other:
            path = f"/v1/responses/{created['id']}?stream=true"
            rest = await read(await opened(other, "GET", f"{path}&starting_after={last}"))
            again = await read(await opened(other, "GET", path))
            stored = await get(other, created["id"])
        # with no gap and no repeat, to the final response as stored
        assert [e["sequence_number"] for e in seen + rest] == list(range(len(seen + rest)))
        assert rest[-1] == {"type": "response.completed", "response": stored,
                            "sequence_number": len(seen + rest) - 1}  # fmt: skip
        assert texts(seen + rest) == stored["output"][0]["content"][0]["text"] == "Hello world"
        assert stored["status"] == "completed" and stored["usage"]["total_tokens"] == 8
        # and streamed from the start, the same events as the first client read
        assert again == seen + rest
        # and the client that left cancelled nothing
        assert not await asyncio.to_thread(fake.cancelled, taken)
        record = json.loads(r.get(response_key(created["id"])) or b"")
        assert "pending" not in record and record["replay"]["model"] == MODEL

    run(redis_url, scenario)


def test_a_restart_is_streamed_as_the_foreground_streams_it(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a streamed background response whose worker died after "Hel"
        stream = await opened(port, "POST", "/v1/responses", STREAMED)
        taken = await asyncio.to_thread(fake.take)
        await worker(fake, taken, "Hel")
        seen = await read(stream, delta_is("Hel"))
        # When another worker generates it again (the same text, then more)
        await worker(fake, taken, "Hel", "lo")
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hello", "finish_reason": "stop"}])
        await asyncio.to_thread(fake.delta, taken, 3, None)
        seen += await read(stream)
        # Then the text repeated is sent once, live and rebuilt alike
        assert texts(seen) == "Hello" and seen[-1]["type"] == "response.completed"
        path = f"/v1/responses/resp_{taken.id}?stream=true"
        assert await read(await opened(port, "GET", path)) == seen

    run(redis_url, scenario)


def test_a_cancel_ends_the_streams_with_the_text_so_far(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        # Given a streamed background response under way, and a second client resuming it
        stream = await opened(port, "POST", "/v1/responses", STREAMED)
        taken = await asyncio.to_thread(fake.take)
        await worker(fake, taken, "Hel")
        seen = await read(stream, delta_is("Hel"))
        rid = seen[0]["response"]["id"]
        path = f"/v1/responses/{rid}?stream=true&starting_after={seen[-1]['sequence_number']}"
        resumed = await opened(port, "GET", path)
        # When it is cancelled
        status, out = await call(port, "POST", f"/v1/responses/{rid}/cancel")
        assert status == 200 and out["status"] == "cancelled"
        assert await asyncio.to_thread(fake.cancelled, taken)
        # and the worker stops with the text it had
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hel", "finish_reason": "cancelled"}])
        await asyncio.to_thread(fake.delta, taken, 2, None)
        # Then both streams end with the response cancelled, holding that text
        rest = await read(stream)
        assert await read(resumed) == rest
        end = rest[-1]
        assert end["type"] == "response.incomplete" and end["response"]["status"] == "cancelled"
        assert end["response"] == await get(port, rid)
        assert end["response"]["output"][0]["content"][0]["text"] == texts(seen + rest) == "Hel"
        # and streamed again from the start, the same events
        assert await read(await opened(port, "GET", f"/v1/responses/{rid}?stream=true")) == (
            seen + rest)  # fmt: skip
        # and one the worker finished before it saw the cancel ends cancelled too, as GET
        # answers it
        stream = await opened(port, "POST", "/v1/responses", STREAMED)
        taken = await asyncio.to_thread(fake.take)
        await worker(fake, taken, "Hello")
        seen = await read(stream, delta_is("Hello"))
        rid = seen[0]["response"]["id"]
        assert (await call(port, "POST", f"/v1/responses/{rid}/cancel"))[0] == 200
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hello", "finish_reason": "stop"}])
        await asyncio.to_thread(fake.delta, taken, 2, None)
        end = (await read(stream))[-1]
        assert end["type"] == "response.incomplete" and end["response"] == await get(port, rid)
        assert end["response"]["status"] == "cancelled"

    run(redis_url, scenario)


def test_a_fleet_error_ends_the_stream_failed(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        stream = await opened(port, "POST", "/v1/responses", STREAMED)
        taken = await asyncio.to_thread(fake.take)
        error = ErrorInfo(code=ErrorCode.INFERENCE_FAILED, message="CUDA out of memory")
        await asyncio.to_thread(fake.answer, taken, Result(id=taken.id, model=MODEL,
                                                           status="error", error=error))  # fmt: skip
        events = await read(stream)
        assert [e["type"] for e in events] == ["response.created", "response.queued",
                                               "response.failed"]  # fmt: skip
        assert events[-1]["response"] == await get(port, events[0]["response"]["id"])
        assert events[-1]["response"]["error"]["code"] == "server_error"

    run(redis_url, scenario)


def test_what_cannot_be_streamed_from_get(redis_url: str, r: redis.Redis) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        async def refused(path: str, param: str | None, status: int = 400) -> str:
            got, out = await call(port, "GET", path)
            assert got == status and out["error"]["param"] == param, out
            return str(out["error"]["message"])

        # a response answered at once (not background): OpenAI's 400
        _, _, whole = await answered(port, fake, {"model": MODEL, "input": "x"}, "ok")
        assert "Only a response created with background" in await refused(
            f"/v1/responses/{whole['id']}?stream=true", "stream")  # fmt: skip
        # bad query values
        assert (await call(port, "GET", f"/v1/responses/{whole['id']}?stream=false"))[0] == 200
        await refused(f"/v1/responses/{whole['id']}?stream=yes", "stream")
        for after in ("x", "1.5", "-1", "--1", ""):
            await refused(f"/v1/responses/{whole['id']}?stream=true&starting_after={after}",
                          "starting_after")  # fmt: skip
        await refused("/v1/responses/resp_nope?stream=true", None, 404)
        # one whose fleet result (and token stream) expired before the response
        _, done = await call(port, "POST", "/v1/responses", ASK)
        taken = await asyncio.to_thread(fake.take)
        await asyncio.to_thread(fake.ok, taken, [{"text": "Hi", "finish_reason": "stop"}])
        assert (await get(port, done["id"]))["status"] == "completed"
        r.delete(ModelKeys(MODEL).result(taken.id), ModelKeys(MODEL).tokens(taken.id))
        assert "no longer kept" in await refused(f"/v1/responses/{done['id']}?stream=true",
                                                 "stream")  # fmt: skip
        # one stored by an older gateway (no replay: its fleet request not streamed)
        key = response_key(done["id"])
        record = json.loads(r.get(key) or b"")
        del record["replay"]
        r.set(key, json.dumps(record))
        assert "older gateway" in await refused(f"/v1/responses/{done['id']}?stream=true",
                                                "stream")  # fmt: skip

    run(redis_url, scenario)


def test_the_openai_client_streams_and_resumes(redis_url: str) -> None:
    async def scenario(port: int, fake: ScriptedWorker) -> None:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=GATEWAY_KEY,
                                    max_retries=0)  # fmt: skip
        # Given a background response streamed by the client, left after its first text
        stream = await client.responses.create(model=MODEL, input="hi", background=True,
                                               stream=True)  # fmt: skip
        taken = await asyncio.to_thread(fake.take)
        await worker(fake, taken, "Par")
        last, rid = -1, ""
        async for event in stream:
            last = event.sequence_number
            if event.type == "response.created":
                rid = event.response.id
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        await asyncio.to_thread(fake.delta, taken, 2, "is.")
        await asyncio.to_thread(fake.ok, taken, [{"text": "Paris.", "finish_reason": "stop"}])
        await asyncio.to_thread(fake.delta, taken, 3, None)
        # When it resumes after the last event it read
        resumed = await client.responses.retrieve(rid, stream=True, starting_after=last)
        events = [event async for event in resumed]
        # Then it gets the rest, ending completed
        assert events[0].sequence_number == last + 1
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "is."
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "Paris."
        await client.close()

    run(redis_url, scenario)
