"""Producer behaviour against a real redis-server: backpressure, outages, validation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import redis
from batchfleet.producer import AsyncProducer, Producer, Result
from batchfleet.schemas.codec import decode_entry
from batchfleet.schemas.errors import (
    ErrorCode,
    JobFailed,
    QueueFull,
    RequestRejected,
    Unavailable,
)
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import StructuredOutputs
from batchfleet.worker.streams import ModelStreams
from pydantic import BaseModel

from batchfleet.redis_server import LocalRedis, free_port

KEYS = ModelKeys("tiny")


def test_queue_full_past_the_lane_depth(r: redis.Redis, redis_url: str) -> None:
    ModelStreams(r, "tiny", 3, "w").ensure_groups(max_depth=5)
    producer = Producer(redis_url)
    for i in range(5):
        producer.submit("tiny", f"text {i}", priority=0)
    with pytest.raises(QueueFull) as info:
        producer.submit("tiny", "one too many", priority=0)
    assert info.value.code is ErrorCode.QUEUE_FULL
    assert r.xlen(KEYS.lane(0)) == 5
    producer.submit("tiny", "another lane has room", priority=1)

    # submit_many stops at the limit and says which went in
    with pytest.raises(QueueFull) as many:
        producer.submit_many("tiny", [f"t{i}" for i in range(10)], priority=2)
    assert len(many.value.accepted) == 5
    assert r.xlen(KEYS.lane(2)) == 5

    # a raw client running the documented script sees QUEUEFULL
    from batchfleet.producer.submit import SUBMIT_LUA

    with pytest.raises(redis.ResponseError, match="QUEUEFULL"):
        r.eval(SUBMIT_LUA, 2, KEYS.lane(0), KEYS.max_depth, "json", "{}")

    # unbounded again once workers publish no limit
    ModelStreams(r, "tiny", 3, "w").ensure_groups(max_depth=None)
    producer.submit("tiny", "room again", priority=0)


def test_unreachable_redis_raises_a_clear_error_quickly() -> None:
    producer = Producer(f"redis://127.0.0.1:{free_port()}/0", retry_for_s=0.5)
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"cannot reach Redis at redis://127\.0\.0\.1"):
        producer.submit("tiny", "hello")
    assert time.monotonic() - started < 30


def test_invalid_requests_are_refused_before_redis(redis_url: str, r: redis.Redis) -> None:
    producer = Producer(redis_url)
    cases = [
        (dict(model="tiny", inputs=[]), ErrorCode.INVALID_REQUEST),
        (dict(model="tiny", inputs=[" "]), ErrorCode.EMPTY_INPUT),
        (dict(model="tiny", inputs=["x" * 30_000]), ErrorCode.TOO_LARGE),
        (dict(model="tiny", inputs=["x"], priority=3), ErrorCode.INVALID_REQUEST),
        (dict(model="tiny", inputs=["x"], deadline_ms=0), ErrorCode.INVALID_REQUEST),
    ]
    for kwargs, code in cases:
        with pytest.raises(RequestRejected) as info:
            producer.submit(**kwargs)  # type: ignore[arg-type]
        assert info.value.code is code, kwargs
    with pytest.raises(ValueError):
        producer.submit("bad name", "x")
    assert not list(r.scan_iter("bf:*"))


def test_submit_many_survives_a_flushed_script_cache(r: redis.Redis) -> None:
    """The submit script is called by EVALSHA alone (no SCRIPT EXISTS first): after Redis
    forgets it (a restart, SCRIPT FLUSH), the NOSCRIPT replies load it and rerun."""
    producer = Producer(client=r)
    first = producer.submit_many("m", ["one", "two"])
    r.script_flush()
    again = producer.submit_many("m", ["three", "four", "five"], priority=2)
    assert len(first) == 2 and len(again) == 3
    keys = ModelKeys("m")
    assert r.xlen(keys.lane(1)) == 2 and r.xlen(keys.lane(2)) == 3


def test_async_submit_many_survives_a_flushed_script_cache(r: redis.Redis, redis_url: str) -> None:
    async def go() -> tuple[int, int]:
        async with AsyncProducer(redis_url) as producer:
            first = await producer.submit_many("am", ["one", "two"], priority=0)
            r.script_flush()
            again = await producer.submit_many("am", ["three"], priority=0)
            return len(first), len(again)

    assert asyncio.run(go()) == (2, 1)
    assert r.xlen(ModelKeys("am").lane(0)) == 3


# --- both producers, one contract: each test runs against Producer and AsyncProducer --------


class Shell:
    """A producer under test, driven through blocking calls (the async one on its own loop
    thread), so one test body covers both."""

    def __init__(self, kind: str, url: str, **options: Any) -> None:
        self.kind = kind
        self.loop: asyncio.AbstractEventLoop | None = None
        if kind == "sync":
            self.producer: Any = Producer(url, **options)
            return
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.producer = self.call(_make_async(url, options))

    def call(self, value: Any) -> Any:
        if self.loop is None:
            return value
        return asyncio.run_coroutine_threadsafe(value, self.loop).result()

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.producer.submit(*args, **kwargs))

    def submit_many(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.producer.submit_many(*args, **kwargs))

    def result(self, job: Any, timeout: float = 30.0) -> Result:
        return self.call(job.result(timeout))  # type: ignore[no-any-return]

    def outputs(self, job: Any, timeout: float = 30.0) -> list[Any]:
        return self.call(job.outputs(timeout))  # type: ignore[no-any-return]

    def results(self, jobs: list[Any], into: queue.Queue[Result], timeout: float = 30.0) -> None:
        """Put each result from ``producer.results(jobs)`` into ``into`` as it comes."""
        if self.loop is None:
            for result in self.producer.results(jobs, timeout):
                into.put(result)
            return

        async def consume() -> None:
            async for result in self.producer.results(jobs, timeout):
                into.put(result)

        self.call(consume())

    def close(self) -> None:
        if self.loop is None:
            self.producer.close()
            return
        self.call(self.producer.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _make_async(url: str, options: dict[str, Any]) -> AsyncProducer:
    return AsyncProducer(url, **options)


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def shells() -> Iterator[Callable[..., Shell]]:
    made: list[Shell] = []

    def make(kind: str, url: str, **options: Any) -> Shell:
        made.append(Shell(kind, url, **options))
        return made[-1]

    yield make
    for shell in made:
        shell.close()


@pytest.fixture
def restartable() -> Iterator[LocalRedis]:
    """A redis-server of the test's own, to crash and start again on the same port."""
    server = LocalRedis()
    server.start()
    yield server
    server.stop()


class OutageSeen(logging.Handler):
    """Set once a producer has logged that Redis is unreachable (it is retrying)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "unreachable" in record.getMessage():
            self.event.set()

    def wait(self) -> None:
        assert self.event.wait(30), "the producer never saw Redis go away"


@pytest.fixture
def outage() -> Iterator[OutageSeen]:
    seen = OutageSeen()
    log = logging.getLogger("batchfleet.producer")
    log.addHandler(seen)
    yield seen
    log.removeHandler(seen)


background = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="producer-test")


def until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` (a state, not a duration) until true."""
    end = time.monotonic() + 30
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def subscribed(client: redis.Redis, channel: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return bool(client.pubsub_numsub(channel)[0][1])
        except redis.ConnectionError:
            return False

    return check


def later_result(rid: str, model: str = "tiny", status: str = "deferred") -> dict[str, Any]:
    """A result as a later v1 worker might write it: a new status, new fields, a new code."""
    return {"v": 1, "id": rid, "model": model, "status": status, "eta_ms": 1500,
            "error": {"code": "overloaded", "message": "try later", "retry_after_ms": 5},
            "timings": {"queued_ms": 1.0, "gpu_ms": 3.0}, "metadata": {}}  # fmt: skip


def test_results_with_unknown_fields_and_statuses_are_read(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    shell = shells(kind, redis_url)
    polled, stored, pushed = shell.submit_many("tiny", ["a", "b", "c"])

    # job.result(): a stored result with an extra field, a new status and a new error code
    r.set(KEYS.result(polled.id), msgpack.packb(later_result(polled.id)))
    result = shell.result(polled)
    assert (result.status, result.ok, result.error.code) == ("deferred", False, "overloaded")
    with pytest.raises(JobFailed) as failed:
        shell.outputs(polled)
    assert failed.value.status == "deferred" and failed.value.error_code == "overloaded"

    # producer.results(): one stored before it starts, one published; non-results skipped
    r.set(KEYS.result(stored.id), json.dumps(later_result(stored.id, status="ok")))
    got: queue.Queue[Result] = queue.Queue()
    done = background.submit(shell.results, [stored, pushed], got)
    assert got.get(timeout=30).id == stored.id  # the sweep after subscribing
    channel = shell.producer.reply_channel
    r.publish(channel, json.dumps({"kind": "progress", "id": pushed.id, "done": 0.5}))
    r.publish(channel, msgpack.packb({"v": 2, "id": pushed.id, "status": "ok"}))
    r.publish(channel, b"\xc1 not a message")
    r.publish(channel, json.dumps(later_result(pushed.id, status="cancelled")))
    done.result(timeout=30)
    last = got.get_nowait()
    assert (last.id, last.status, last.timings.queued_ms) == (pushed.id, "cancelled", 1.0)
    assert got.empty()


def test_wait_survives_a_redis_restart(
    kind: str, restartable: LocalRedis, shells: Callable[..., Shell], outage: OutageSeen
) -> None:
    # Given a submitted request and a Redis that dies before its result is written
    shell = shells(kind, restartable.url)
    job = shell.submit("tiny", "hello", request_id="req-restart")
    restartable.crash()
    waiting = background.submit(shell.result, job, 60)
    outage.wait()

    # When Redis comes back and the result is written (the restart lost the stream: no AOF)
    restartable.start()
    client = redis.Redis.from_url(restartable.url)
    client.set(KEYS.result(job.id), msgpack.packb(later_result(job.id, status="ok")))

    # Then the same job.result() call returns it
    assert waiting.result(timeout=60).id == "req-restart"
    client.close()


def test_results_resubscribe_and_sweep_after_a_redis_restart(
    kind: str, restartable: LocalRedis, shells: Callable[..., Shell], outage: OutageSeen
) -> None:
    shell = shells(kind, restartable.url, sweep_s=0.2)
    published, stored = shell.submit_many("tiny", ["a", "b"])
    got: queue.Queue[Result] = queue.Queue()
    done = background.submit(shell.results, [published, stored], got, 60)
    client = redis.Redis.from_url(restartable.url)
    until(subscribed(client, shell.producer.reply_channel), "never subscribed")

    # When Redis restarts under the listener
    restartable.crash()
    outage.wait()
    restartable.start()

    # Then it subscribes again (a result published now arrives) ...
    until(subscribed(client, shell.producer.reply_channel), "never subscribed again")
    client.publish(
        shell.producer.reply_channel, msgpack.packb(later_result(published.id, "tiny", "ok"))
    )
    assert got.get(timeout=30).id == published.id
    # ... and reads results stored without a message (a publish nobody heard)
    client.set(KEYS.result(stored.id), msgpack.packb(later_result(stored.id, "tiny", "ok")))
    done.result(timeout=60)
    assert got.get_nowait().id == stored.id
    client.close()


def test_results_sweep_stored_results_after_a_quiet_spell(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    shell = shells(kind, redis_url, sweep_s=0.2)
    first, quiet = shell.submit_many("tiny", ["a", "b"])
    got: queue.Queue[Result] = queue.Queue()
    done = background.submit(shell.results, [first, quiet], got)
    until(subscribed(r, shell.producer.reply_channel), "never subscribed")
    r.publish(shell.producer.reply_channel, msgpack.packb(later_result(first.id, status="ok")))
    assert got.get(timeout=30).id == first.id  # past the sweep that follows subscribing

    # When a result is stored but its message is lost
    r.set(KEYS.result(quiet.id), msgpack.packb(later_result(quiet.id, status="ok")))

    # Then a later sweep finds it
    done.result(timeout=30)
    assert got.get_nowait().id == quiet.id


def lane_ids(client: redis.Redis, lane: int = 1) -> list[str]:
    entries = client.xrange(KEYS.lane(lane))
    return [decode_entry(fields, "tiny")[0].id for _, fields in entries]


@pytest.mark.parametrize("many", [False, True], ids=["submit", "submit_many"])
def test_submit_retries_through_a_redis_restart(
    kind: str,
    many: bool,
    restartable: LocalRedis,
    shells: Callable[..., Shell],
    outage: OutageSeen,
) -> None:
    # Given a Redis that is down when the request is submitted
    shell = shells(kind, restartable.url, retry_for_s=60)
    restartable.crash()
    if many:
        submitting = background.submit(shell.submit_many, "tiny", ["a", "b"])
    else:
        submitting = background.submit(shell.submit, "tiny", "hello", request_id="fixed-id")
    outage.wait()

    # When it comes back within the retry time
    restartable.start()

    # Then the submit returns, and each id is in the lane once (or twice: an unknown
    # outcome retried; the same id gets one result)
    jobs = submitting.result(timeout=60)
    ids = [j.id for j in jobs] if many else [jobs.id]
    assert ids == (ids if many else ["fixed-id"])
    client = redis.Redis.from_url(restartable.url)
    in_lane = lane_ids(client)
    assert set(in_lane) == set(ids) and all(1 <= in_lane.count(i) <= 2 for i in ids)
    client.close()


def test_submit_gives_up_after_retry_for_s_naming_the_unknown_ids(
    kind: str, restartable: LocalRedis, shells: Callable[..., Shell]
) -> None:
    shell = shells(kind, restartable.url, retry_for_s=0.3)
    shell.submit("tiny", "lanes are cached now")
    restartable.crash()
    with pytest.raises(Unavailable) as one:
        shell.submit("tiny", "hello", request_id="lost-1")
    assert one.value.unknown_ids == ["lost-1"]
    with pytest.raises(Unavailable) as many:
        shell.submit_many("tiny", ["a", "b", "c"])
    assert len(many.value.unknown_ids) == 3 and many.value.accepted == []
    assert "outcome unknown for 3 requests" in str(many.value)


def test_a_job_shows_where_its_webhook_delivery_stands(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    from batchfleet.webhooks import status

    shell = shells(kind, redis_url)
    job = shell.submit("tiny", "a", webhook="https://example.com/hook")
    assert shell.call(job.webhook_status()) is None  # no attempt finished yet
    # When a webhooks worker records a refused delivery (the URL failed the SSRF policy)
    refused = status.WebhookStatus(state="refused", webhook_id="msg_1", url="https://example.com/hook",
                                   attempts=1, reason="refused: private address", updated_ms=1)  # fmt: skip
    status.write(r, "tiny", job.id, refused, ttl_s=60)
    # Then the submitter sees it
    assert shell.call(job.webhook_status()) == refused


# --- generation: requests, token streams, cancel (a fake worker writes the streams) ---------


def collect(shell: Shell, items: Any, into: queue.Queue[Any] | None = None) -> list[Any]:
    """Everything ``items`` (a job's ``stream()`` or ``deltas()``, sync or async) yields, also
    put into ``into`` as it comes."""
    got: list[Any] = []

    def take(item: Any) -> None:
        got.append(item)
        if into is not None:
            into.put(item)

    if shell.loop is None:
        for item in items:
            take(item)
        return got

    async def consume() -> None:
        async for item in items:
            take(item)

    shell.call(consume())
    return got


def write_deltas(client: redis.Redis, rid: str, *deltas: tuple[int, str], end: int = 0) -> None:
    """Token-stream entries as the worker appends them (``(seq, text)`` of input 0), and the
    end entry ``end`` if set."""
    from batchfleet.worker.token_stream import TokenWrite

    writes = [TokenWrite(rid, seq, 60, text, tokens=1) for seq, text in deltas]
    if end:
        writes.append(TokenWrite(rid, end, 60))
    ModelStreams(client, "tiny", 3, "fake-worker").append_tokens(writes)


def store_generation(client: redis.Redis, rid: str, *texts: str) -> None:
    outputs = [{"text": t, "finish_reason": "stop", "prompt_tokens": 3,
                "completion_tokens": 2} for t in texts]  # fmt: skip
    body = {"v": 1, "id": rid, "model": "tiny", "status": "ok", "outputs": outputs,
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}  # fmt: skip
    client.set(KEYS.result(rid), msgpack.packb(body))


class Answer(BaseModel):
    city: str
    population: int


def test_generation_requests_carry_their_fields(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    shell = shells(kind, redis_url)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    job = shell.submit("tiny", messages=chat, max_new_tokens=20, temperature=0.7, top_p=0.9,
                       top_k=40, seed=7, stop="\n", stream=True, repetition_penalty=1.1,
                       presence_penalty=0.5, frequency_penalty=-0.5, min_new_tokens=3,
                       logprobs=4, stop_token_ids=(7, 9), n=2,
                       logit_bias={50: -100, 7: 2.5}, ignore_eos=True, min_p=0.1,
                       include_stop_str_in_output=True, truncate_prompt_tokens=50,
                       prompt_logprobs=3, structured_outputs={"json": Answer},
                       allowed_token_ids=(1, 2), skip_special_tokens=False, bad_words=["x"],
                       chat_template_kwargs={"enable_thinking": False},
                       add_generation_prompt=True)  # fmt: skip
    prompts, talk = shell.submit_many("tiny", [["a", "b"], chat], max_new_tokens=5,
                                      structured_outputs=StructuredOutputs(regex="[ab]"))  # fmt: skip
    shell.submit("tiny", "x", response_format={"type": "json_object"})
    called = [*chat, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
        {"role": "tool", "content": "Paris", "tool_call_id": "c1"}]  # fmt: skip
    shell.submit("tiny", messages=called, tools=[{"type": "function", "function": {
        "name": "look", "parameters": Answer}}], tool_choice={"type": "function",
        "function": {"name": "look"}})  # fmt: skip
    (request, many, chat_many, formatted, tooled) = [
        decode_entry(f, "tiny")[0] for _, f in r.xrange(KEYS.lane(1))
    ]
    assert tooled.tools is not None and tooled.messages is not None
    assert tooled.tools[0].function.parameters == Answer.model_json_schema()
    assert tooled.messages[1].tool_calls is not None and tooled.messages[1].content is None
    assert tooled.messages[2].tool_call_id == "c1"
    assert tooled.constraint == StructuredOutputs.model_validate(
        {"json": Answer.model_json_schema(), "disable_any_whitespace": True}
    )
    assert request.messages is not None and request.messages[0].content == chat[0]["content"]
    assert (request.inputs, request.max_new_tokens, request.temperature, request.top_p,
            request.top_k, request.seed, request.stop, request.stream) == (
            [], 20, 0.7, 0.9, 40, 7, ["\n"], True)  # fmt: skip
    assert (request.repetition_penalty, request.presence_penalty, request.frequency_penalty,
            request.min_new_tokens, request.logprobs, request.stop_token_ids, request.n) == (
            1.1, 0.5, -0.5, 3, 4, [7, 9], 2)  # fmt: skip
    assert request.logit_bias == {"50": -100.0, "7": 2.5} and request.ignore_eos is True
    assert request.min_p == 0.1 and request.include_stop_str_in_output is True
    assert request.truncate_prompt_tokens == 50 and request.prompt_logprobs == 3
    assert (request.allowed_token_ids, request.skip_special_tokens, request.bad_words) == (
        [1, 2], False, ["x"])  # fmt: skip
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert request.add_generation_prompt is True
    assert request.structured_outputs is not None  # a pydantic class goes as its schema
    assert request.structured_outputs.json_schema == Answer.model_json_schema()
    assert many.structured_outputs == StructuredOutputs(regex="[ab]")
    assert formatted.constraint == StructuredOutputs(json_object=True)
    assert (job.streaming, job.input_count, job.output_count) == (True, 1, 2)
    assert (many.inputs, many.max_new_tokens, many.stream) == (["a", "b"], 5, None)
    assert chat_many.messages is not None and (prompts.input_count, talk.input_count) == (2, 1)
    with pytest.raises(RequestRejected):
        shell.submit("tiny", "both", messages=chat)
    with pytest.raises(RequestRejected):
        shell.submit("tiny", "x", max_new_tokens=-1)
    with pytest.raises(RequestRejected, match="min_new_tokens 1 > max_new_tokens 0"):
        shell.submit("tiny", "x", max_new_tokens=0, min_new_tokens=1)
    # 0: the prompt only (a tokenizer's count, a prompt's score), here with its text
    shell.submit("tiny", "x", max_new_tokens=0, return_prompt_text=True)
    *_, counted = [decode_entry(f, "tiny")[0] for _, f in r.xrange(KEYS.lane(1))]
    assert (counted.max_new_tokens, counted.return_prompt_text) == (0, True)


def test_stream_yields_the_text_until_the_end_entry(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    # Given a streaming request and a reader that starts before any token
    shell = shells(kind, redis_url)
    job = shell.submit("tiny", "capital of France?", stream=True)
    texts: queue.Queue[Any] = queue.Queue()
    reading = background.submit(collect, shell, job.stream(), texts)

    # When the worker streams three deltas, stores the result, then ends the stream
    write_deltas(r, job.id, (1, "The capital"), (2, " is"))
    assert texts.get(timeout=30) == "The capital"  # read as it comes
    write_deltas(r, job.id, (3, " Paris."))
    store_generation(r, job.id, "The capital is Paris.")
    write_deltas(r, job.id, end=4)

    # Then the pieces add up to the result's text, and a late reader reads it all again
    assert "".join(reading.result(timeout=30)) == shell.call(job.text()) == "The capital is Paris."
    deltas = collect(shell, job.deltas())
    assert [(d.seq, d.input, d.text, d.tokens) for d in deltas] == [
        (1, 0, "The capital", 1), (2, 0, " is", 1), (3, 0, " Paris.", 1)]  # fmt: skip
    assert shell.result(job).generations()[0].finish_reason == "stop"


def test_stream_yields_a_part_of_the_text(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    # Given a reasoning model's deltas: each with its pieces of reasoning and answer
    from batchfleet.worker.token_stream import TokenWrite

    shell = shells(kind, redis_url)
    job, plain = shell.submit_many("tiny", ["why?", "hi"], stream=True)
    pieces = [("<think>So", "So", ""), (" it is.</think>", " it is.", ""), ("\n\nYes", "", "Yes"),
              ("!", "", "!")]  # fmt: skip
    writes = [TokenWrite(job.id, k + 1, 60, text, tokens=1, content=answer, reasoning=thought)
              for k, (text, thought, answer) in enumerate(pieces)]  # fmt: skip
    ModelStreams(r, "tiny", 3, "fake-worker").append_tokens([*writes, TokenWrite(job.id, 5, 60)])
    # Then stream() yields the text, or its answer, or its reasoning
    assert "".join(collect(shell, job.stream())) == "<think>So it is.</think>\n\nYes!"
    assert collect(shell, job.stream(part="content")) == ["Yes", "!"]
    assert collect(shell, job.stream(part="reasoning_content")) == ["So", " it is."]
    # and a request whose deltas carry no parts: all its text is its answer
    write_deltas(r, plain.id, (1, "Hel"), (2, "lo"), end=3)
    assert collect(shell, plain.stream(part="content")) == ["Hel", "lo"]
    assert collect(shell, plain.stream(part="reasoning_content")) == []


def test_stream_ends_at_a_stored_result_without_end_entry(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    # Given a worker that died between storing the result and appending the end entry
    shell = shells(kind, redis_url)
    job = shell.submit("tiny", "hi", stream=True)
    write_deltas(r, job.id, (1, "Hello"), (2, "!"))
    store_generation(r, job.id, "Hello!")
    # Then the reader stops all the same
    assert collect(shell, job.stream()) == ["Hello", "!"]


def test_a_restarted_generation_is_followed_or_refused(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    from batchfleet.producer.tokens import Restarted
    from batchfleet.schemas.errors import StreamRestarted

    shell = shells(kind, redis_url)
    same, other = shell.submit_many("tiny", ["a", "b"], stream=True)
    # Given a worker that died after two deltas, and another that generates again from seq 1
    write_deltas(r, same.id, (1, "The "), (2, "cap"), (1, "The "), (2, "cap"), (3, "ital"), end=4)
    # Then stream() does not repeat the text it gave, and deltas() marks the restart
    assert collect(shell, same.stream()) == ["The ", "cap", "ital"]
    marks = [type(d).__name__ if isinstance(d, Restarted) else d.seq
             for d in collect(shell, same.deltas())]  # fmt: skip
    assert marks == [1, 2, "Restarted", 1, 2, 3]

    # When the text generated again differs from what was streamed
    write_deltas(r, other.id, (1, "Yes"), (1, "No"), (2, " way"), end=3)
    got: queue.Queue[Any] = queue.Queue()
    with pytest.raises(StreamRestarted) as info:
        collect(shell, other.stream(), got)
    assert info.value.request_id == other.id and got.get_nowait() == "Yes" and got.empty()

    # When the attempt that ends it streams nothing (taken over past its deadline, found by
    # bench.gen_chaos): its end's seq is not above the last delta's
    ended = shell.submit("tiny", "c", stream=True)
    write_deltas(r, ended.id, (1, "Yes"), (2, " no"), end=1)
    # Then deltas() marks the restart before it ends, and stream() refuses the void text
    marks = [type(d).__name__ if isinstance(d, Restarted) else d.seq
             for d in collect(shell, ended.deltas())]  # fmt: skip
    assert marks == [1, 2, "Restarted"]
    with pytest.raises(StreamRestarted):
        collect(shell, ended.stream())


def test_stream_needs_stream_true_and_one_input_and_honours_its_timeout(
    kind: str, redis_url: str, shells: Callable[..., Shell]
) -> None:
    from batchfleet.schemas.errors import NotStreamed, ResultTimeout

    shell = shells(kind, redis_url)
    plain, two = shell.submit("tiny", "x"), shell.submit("tiny", ["a", "b"], stream=True)
    twice = shell.submit("tiny", "x", stream=True, n=2)
    with pytest.raises(NotStreamed, match="stream=True"):
        plain.stream()
    with pytest.raises(NotStreamed):
        plain.deltas()
    with pytest.raises(ValueError, match=r"job\.deltas"):
        two.stream()
    with pytest.raises(ValueError, match=r"2 outputs \(1 inputs\)"):
        twice.stream()
    with pytest.raises(ResultTimeout):
        collect(shell, two.deltas(timeout=0.3))  # nothing is generating it


def test_cancel_sets_the_documented_key_with_a_ttl(
    kind: str, r: redis.Redis, redis_url: str, shells: Callable[..., Shell]
) -> None:
    shell = shells(kind, redis_url)
    job, other = shell.submit_many("tiny", ["a", "b"], stream=True)
    shell.call(shell.producer.cancel(job))
    shell.call(other.cancel(ttl_s=60))
    shell.call(shell.producer.cancel("by-id", model="tiny", ttl_s=90))
    assert r.get(KEYS.cancel(job.id)) == b"1" and 3500 < r.ttl(KEYS.cancel(job.id)) <= 3600
    assert 0 < r.ttl(KEYS.cancel(other.id)) <= 60 and 60 < r.ttl(KEYS.cancel("by-id")) <= 90
    # what a worker polls
    assert ModelStreams(r, "tiny", 3, "w").cancelled([job.id, "x", "by-id"]) == [job.id, "by-id"]
    with pytest.raises(ValueError, match="model="):
        shell.call(shell.producer.cancel("by-id"))


def test_stream_survives_a_redis_restart(
    kind: str, restartable: LocalRedis, shells: Callable[..., Shell], outage: OutageSeen
) -> None:
    # Given a reader that has read the first delta
    shell = shells(kind, restartable.url)
    job = shell.submit("tiny", "hello", stream=True)
    client = redis.Redis.from_url(restartable.url)
    texts: queue.Queue[Any] = queue.Queue()
    reading = background.submit(collect, shell, job.stream(timeout=60), texts)
    write_deltas(client, job.id, (1, "one"))
    assert texts.get(timeout=30) == "one"

    # When Redis restarts (losing the stream: no AOF) and the worker goes on writing
    restartable.crash()
    outage.wait()
    restartable.start()
    write_deltas(client, job.id, (2, " two"))
    store_generation(client, job.id, "one two")
    write_deltas(client, job.id, end=3)

    # Then the same stream() call yields the rest
    assert reading.result(timeout=60) == ["one", " two"]
    client.close()


def test_async_producer_awaits_hundreds_of_results_at_once(
    redis_url: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    from batchfleet.schemas.codec import encode_result

    # Given 300 requests awaited at once (more than a connection pool's default 100), whose
    # results arrive while they all poll
    async def go() -> list[Result]:
        async with AsyncProducer(redis_url) as producer:
            jobs = [await producer.submit("many", inputs=f"t{i}") for i in range(300)]
            waits = [asyncio.ensure_future(job.result(timeout=60)) for job in jobs]
            await asyncio.sleep(0.5)  # every wait has polled
            for job in jobs:
                done = Result(id=job.id, model="many", status="ok", outputs=[[1.0]])
                r.set(ModelKeys("many").result(job.id), encode_result(done))
            return await asyncio.gather(*waits)

    with caplog.at_level(logging.WARNING):
        results = asyncio.run(go())
    # Then each gets its result, and no command failed for want of a connection
    assert len(results) == 300 and all(res.ok for res in results)
    assert "Redis unreachable" not in caplog.text


def test_hundreds_of_async_waits_cancelled_at_once_all_end(redis_url: str) -> None:
    # Given 300 result() waits polling for results that never come
    async def go() -> tuple[int, int]:
        async with AsyncProducer(redis_url) as producer:
            jobs = [await producer.submit("idle", inputs=f"t{i}") for i in range(300)]
            waits = [asyncio.ensure_future(job.result(timeout=600)) for job in jobs]
            await asyncio.sleep(0.5)  # every wait has polled
            # When they are all cancelled (a server's clients gone at once)
            for wait in waits:
                wait.cancel()
            done, pending = await asyncio.wait(waits, timeout=60)
            return len(pending), sum(w.cancelled() for w in done)

    # Then every one ends, cancelled (none goes on polling until its timeout)
    assert asyncio.run(go()) == (0, 300)
