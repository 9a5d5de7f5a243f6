"""The result sinks, one contract for both: the Redis sink against a real Redis, and the
in-memory one the virtual-time tests use. First result stands; a duplicate entry gets it
published again; partial outputs and dead letters land; observers hear what was stored."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import redis
from batchfleet.producer.tokens import parse_entry
from batchfleet.schemas.codec import decode_delta, decode_result, encode_delta
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Delta, Request, Result, Timings
from batchfleet.worker.answers import Outgoing
from batchfleet.worker.observers import Answered, DeadLettered, LoopEvent, Observers
from batchfleet.worker.sink import MemorySink, RedisSink
from batchfleet.worker.streamed import Streamed
from batchfleet.worker.streams import Entry, ModelStreams
from batchfleet.worker.token_writes import Sent

MODEL = "tiny"
KEYS = ModelKeys(MODEL)


@dataclass
class Heard:
    events: list[LoopEvent] = field(default_factory=list)

    def notify(self, event: LoopEvent) -> None:
        self.events.append(event)


@dataclass
class Harness:
    """One sink with what the contract needs to see of it."""

    sink: Any
    heard: Heard
    entries: list[Entry]
    stored: Any  # request id -> bytes | None
    published: Any  # channel -> list of payloads
    partials: Any  # request id -> list of chunks
    dead_codes: Any  # () -> list of codes
    pending: Any  # () -> number of entries not acked


def outgoing(entry: Entry, rid: str, status: str = "ok", reply: str | None = "chan") -> Outgoing:
    req = Request(id=rid, model=MODEL, inputs=["x"], reply=reply)
    result = Result.model_construct(id=rid, model=MODEL, status=status, outputs=[[1.0]],
                                    metadata={}, timings=Timings(), finished_at_ms=1)  # fmt: skip
    return Outgoing(entry, req, result, "msgpack", 60, reply)


@pytest.fixture(params=["redis", "memory"])
def harness(request: pytest.FixtureRequest, r: redis.Redis) -> Iterator[Harness]:
    heard = Heard()
    if request.param == "memory":
        mem = MemorySink(MODEL, Observers([heard]))
        entries = [Entry(0, f"1-{i}", {b"msgpack": b"x"}) for i in range(4)]
        yield Harness(
            mem, heard, entries, mem.results.get, lambda ch: mem.published.get(ch, []),
            lambda rid: mem.tokens.get(rid, []), lambda: [c for _, c, _ in mem.dead],
            lambda: len(entries) - len({e.key for e in mem.acked}),
        )  # fmt: skip
        return
    streams = ModelStreams(r, MODEL, 3, "w")
    streams.ensure_groups()
    for _ in range(4):
        r.xadd(KEYS.lane(0), {"msgpack": b"x"})
    entries = streams.read({0: 4}, None)
    sink = RedisSink(streams, Observers([heard]), lambda: None, dead_letter_maxlen=100)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("chan")
    got: dict[str, list[bytes]] = {}

    def published(channel: str) -> list[bytes]:
        end = time.monotonic() + 1.0  # a third publish, if there were one, would come by then
        while time.monotonic() < end:
            if (msg := pubsub.get_message(timeout=0.1)) is not None:
                got.setdefault(msg["channel"].decode(), []).append(msg["data"])
        return got.get(channel, [])

    def partials(rid: str) -> list[Any]:
        return [dict(f) for _, f in r.xrange(KEYS.tokens(rid))]

    sink.start()
    yield Harness(
        sink, heard, entries, lambda rid: r.get(KEYS.result(rid)), published, partials,
        lambda: [f[b"code"].decode() for _, f in r.xrange(KEYS.dead)],
        lambda: r.xpending(KEYS.lane(0), GROUP)["pending"],
    )  # fmt: skip
    sink.close(5)
    pubsub.close()


def test_results_are_stored_once_published_and_acked(harness: Harness) -> None:
    a, b, c, _ = harness.entries
    harness.sink.send([outgoing(a, "r1"), outgoing(b, "r2", status="error")])
    harness.sink.send([outgoing(c, "r1", status="error")])  # a second entry of r1
    harness.sink.close(5)
    first = harness.stored("r1")
    assert (
        decode_result(first).status == "ok"
        and decode_result(harness.stored("r2")).status == "error"
    )
    # r1's stored result stands, and is published again for the second entry
    assert harness.published("chan").count(first) == 2
    assert harness.pending() == 1  # only the fourth entry, never sent, is still pending
    answered = [e for e in harness.heard.events if isinstance(e, Answered)]
    assert [[rep.stored for rep in e.replies] for e in answered] == [[True, True], [False]]
    assert harness.sink.backlog == 0


def test_an_output_the_wire_cannot_carry_becomes_an_error_result(harness: Harness) -> None:
    out = outgoing(harness.entries[0], "odd")
    bad = Outgoing(out.entry, out.request, out.result.model_copy(update={"outputs": [object()]}),
                   "msgpack", 60, None)  # fmt: skip
    harness.sink.send([bad])
    harness.sink.close(5)
    res = decode_result(harness.stored("odd"))
    assert res.status == "error" and "cannot be encoded" in res.error.message


def test_token_streams_and_dead_letters(harness: Harness) -> None:
    def delta(seq: int, text: str) -> Delta:
        return Delta(id="gen-1", model="m", seq=seq, input=0, text=text, tokens=1)

    harness.sink.stream([Streamed.of(delta(1, "Hél"), 60, "chan", "json"),
                         Streamed.of(delta(2, "lo"), 60, "chan", "msgpack")])  # fmt: skip
    harness.sink.stream([Streamed("gen-1", 3, None, 60, "chan", "json")])
    harness.sink.dead_letter(harness.entries[3], "malformed", "not msgpack")
    harness.sink.close(5)
    assert harness.partials("gen-1") == [
        {b"seq": b"1", b"input": b"0", b"text": "Hél".encode(), b"tokens": b"1"},
        {b"seq": b"2", b"input": b"0", b"text": b"lo", b"tokens": b"1"},
        {b"seq": b"3", b"end": b"1"},
    ]
    published = harness.published("chan")
    assert json.loads(published[0]) == delta(1, "Hél").model_dump(mode="json", exclude_none=True)
    assert msgpack.unpackb(published[1]) == delta(2, "lo").model_dump(
        mode="json", exclude_none=True
    )
    assert len(published) == 2  # the end is not published: the result is
    assert harness.dead_codes() == ["malformed"]
    assert [e.code for e in harness.heard.events if isinstance(e, DeadLettered)] == ["malformed"]


def test_requests_started_are_marked_with_the_worker_s_name_and_their_ttl(
    r: redis.Redis,
) -> None:
    streams = ModelStreams(r, MODEL, 3, "gpu-0")
    sink = RedisSink(streams, Observers(), lambda: None, dead_letter_maxlen=100)
    sink.start()
    sink.started([("a", 60), ("b", 7200)])
    sink.close(5)  # everything handed over is written first
    assert (r.get(KEYS.started("a")), r.get(KEYS.started("b"))) == (b"gpu-0", b"gpu-0")
    assert 0 < r.ttl(KEYS.started("a")) <= 60 and 3600 < r.ttl(KEYS.started("b")) <= 7200


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_delta_messages_built_in_redis_decode_as_the_protocol_delta(
    harness: Harness, fmt: str
) -> None:
    # Given texts a JSON or msgpack encoder could get wrong (escapes, control characters,
    # non-ASCII, every msgpack string length class) and a multi-input request, with each
    # optional field given or left out
    texts = ['say "hi" \\ back/slash\n\ttab\x01', "Zürich ☃ 😀", "x" * 31, "y" * 32,
             "é" * 200, "z" * 70_000]  # fmt: skip
    deltas = [Delta(id="gen-2", model="m-1", seq=i + 1, input=i % 2, text=t, tokens=i + 1,
                    logprobs=_logprobs(t, i) if i % 3 else None,
                    tool_calls=_calls(t, i) if i % 2 == 0 else None,
                    tool_call_chunks=_chunks(t, i) if i % 3 != 1 else None,
                    # a split output's pieces: empty ones, and with or without the others
                    content=t[: 7 * (i % 3)] if i % 2 else None,
                    reasoning_content=t[-3:] if i == 3 else "" if i == 1 else None,
                    token_ids=list(range(i, 3 * i)) if i % 4 != 1 else None,
                    prompt_tokens=[17, 4, None][i % 3],  # an output's first only
                    # an input's first output's first: its prompt (the first token null)
                    prompt_text=t if i % 3 == 0 else None,
                    prompt_logprobs=[None, *_logprobs(t, i)] if i in (0, 4) else None,
                    # an output's first, with return_token_ids
                    prompt_token_ids=list(range(5 * i, 6 * i + 1)) if i % 3 == 1 else None)
              for i, t in enumerate(texts)]  # fmt: skip
    # When the sink writes them (tokens.lua encodes the messages)
    harness.sink.stream([Streamed.of(d, 60, "chan", fmt) for d in deltas])  # type: ignore[arg-type]
    harness.sink.close(5)
    # Then each message decodes to the protocol's Delta, as the Python encoder writes it
    published = harness.published("chan")
    decode = json.loads if fmt == "json" else msgpack.unpackb
    assert [decode(m) for m in published] == [
        d.model_dump(mode="json", exclude_none=True) for d in deltas
    ]
    assert [decode(encode_delta(d, fmt)) for d in deltas] == [decode(m) for m in published]  # type: ignore[arg-type]
    assert [decode_delta(decode(m)) for m in published] == deltas
    # and the token stream holds the same text, byte for byte, and reads back as the deltas
    entries = harness.partials("gen-2")
    assert [e[b"text"].decode() for e in entries] == texts
    assert [parse_entry(KEYS, "gen-2", e) for e in entries] == [
        d.model_copy(update={"model": KEYS.model}) for d in deltas
    ]


def _calls(text: str, i: int) -> list[dict[str, Any]]:
    """Tool calls completed by a delta: arguments as JSON text, escapes and non-ASCII."""
    args = json.dumps({"q": text[:40], "n": i, "none": None}, ensure_ascii=False)
    return [{"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": args}},
            {"id": "call_x", "type": "function", "function": {"name": "g.h", "arguments": "{}"}}
            ][: 1 + i % 4 // 2]  # fmt: skip


def _chunks(text: str, i: int) -> list[dict[str, Any]]:
    """Pieces of calls being written: a call's first (id, type, name, empty arguments) and
    later ones (arguments only), escapes and non-ASCII in them."""
    first = {"index": i, "id": f"call_{i}", "type": "function",
             "function": {"name": "f", "arguments": ""}}  # fmt: skip
    return [first, {"index": i, "function": {"arguments": json.dumps(text[:9])[:-1]}},
            {"index": i + 1, "function": {"arguments": '"}'}}][i % 2 :]  # fmt: skip


def _logprobs(text: str, i: int) -> list[dict[str, Any]]:
    """A delta's log-probabilities: escapes and non-ASCII in token texts, an empty list of
    alternatives, a probability of 1 (logprob 0.0, integral), a tiny one; float32 values,
    as the worker's are (both encoders then pack them as float32)."""
    top = [{"token": 3, "text": text[:5], "logprob": -0.5}, {"token": 70000, "text": "\"\n",
            "logprob": -(2.0**-30)}]  # fmt: skip
    return [{"token": 3, "text": text[:5], "logprob": 0.0, "top": top[: i % 3]},
            {"token": 12345 + i, "text": "😀", "logprob": -123.456787109375, "top": []}]  # fmt: skip


def _one_field(name: str) -> Any:
    return {"logprobs": _logprobs("a", 1), "tool_calls": _calls("a", 0),
            "tool_call_chunks": _chunks("a", 0), "content": "c", "reasoning_content": "",
            "token_ids": [1, 2], "prompt_tokens": 5, "prompt_text": "p",
            "prompt_logprobs": [None, *_logprobs("a", 1)], "prompt_token_ids": []}[name]  # fmt: skip


@pytest.mark.parametrize("field", [None, "logprobs", "tool_calls", "tool_call_chunks", "content",
                                   "reasoning_content", "token_ids", "prompt_tokens",
                                   "prompt_text", "prompt_logprobs", "prompt_token_ids"])  # fmt: skip
def test_a_delta_with_one_optional_field_or_none_carries_just_that(
    harness: Harness, field: str | None
) -> None:
    # (most deltas have none: the worker writes those on a shorter path)
    extra = {} if field is None else {field: _one_field(field)}
    delta = Delta(id="gen-3", model="m", seq=1, input=0, text="t", tokens=1, **extra)
    harness.sink.stream([Streamed.of(delta, 60, "chan", "msgpack")])
    harness.sink.close(5)
    (message,) = harness.published("chan")
    assert msgpack.unpackb(message) == delta.model_dump(mode="json", exclude_none=True)
    (entry,) = harness.partials("gen-3")
    assert parse_entry(KEYS, "gen-3", entry) == delta.model_copy(update={"model": KEYS.model})


def test_a_token_stream_ttl_is_set_with_its_first_entry_every_64th_and_its_end() -> None:
    def write(seq: int, end: bool = False) -> bool:
        return Streamed("g", seq, None if end else "x", 60, "chan", "json").write().ttl_s > 0

    assert [s for s in range(1, 200) if write(s)] == [1, 65, 129, 193]
    assert write(7, end=True)


def test_deltas_are_written_at_once_unless_a_token_write_waits_for_the_writer(
    r: redis.Redis,
) -> None:
    streams = ModelStreams(r, MODEL, 3, "w")
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)

    def delta(rid: str, seq: int) -> Streamed:
        return Streamed(rid, seq, f"t{seq}", 60, None, "msgpack", tokens=1, model="m")

    def seqs(rid: str) -> list[bytes]:
        return [f[b"seq"] for _, f in r.xrange(KEYS.tokens(rid))]

    sink.stream_now([delta("now", 1), delta("now", 2)])  # writer thread not even started
    sink.settle()
    assert seqs("now") == [b"1", b"2"]
    sink.stream([delta("queued", 1)])  # waits for the writer thread...
    sink.stream_now([delta("queued", 2)])  # ...so this one waits behind it, in order
    sink.settle()
    assert seqs("queued") == []
    sink.start()
    sink.close(5)
    assert seqs("queued") == [b"1", b"2"]
    sink.stream_now([delta("now", 3)])  # nothing waits any more: at once again
    sink.settle()
    assert seqs("now") == [b"1", b"2", b"3"]


def test_what_is_handed_over_waits_for_the_answer_to_deltas_sent_at_once(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given deltas sent at once whose answer is lost (the connection dropped after sending)
    streams = ModelStreams(r, MODEL, 3, "w")
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)
    sent: list[object] = []
    readers: list[str] = []
    monkeypatch.setattr(sink._direct, "send", lambda items: sent.append(items) or "sent")

    def lost(_: object) -> None:
        readers.append(threading.current_thread().name)
        raise redis.ConnectionError("lost")

    monkeypatch.setattr(sink._direct, "receive", lost)

    def delta(seq: int, text: str | None = "t") -> Streamed:
        return Streamed("g", seq, text, 60, None, "msgpack", tokens=1, model="m")

    sink.stream_now([delta(1), delta(2)])
    assert len(sent) == 1 and not readers  # the device thread does not wait for Redis
    # When the loop hands over the stream's end before anyone read the answer
    sink.stream([delta(3, None)])
    sink.start()
    sink.close(5)
    # Then the writer thread read it, and wrote the deltas again, before the end
    assert readers == ["sink"]
    assert len(sent) == 1
    assert [f[b"seq"] for _, f in r.xrange(KEYS.tokens("g"))] == [b"1", b"2", b"3"]


@pytest.mark.parametrize("life", [1, -1])  # unchecked (the usual), checked (suspect)
def test_deltas_redis_wrote_whose_answer_was_lost_are_not_written_twice(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch, life: int
) -> None:
    # Given deltas sent at once that Redis wrote, the answer then lost (Redis killed
    # between running the call and replying: found by bench.gen_chaos)
    streams = ModelStreams(r, MODEL, 3, "w")
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)

    receive = sink._direct.receive

    def lost(sent: Sent) -> None:
        receive(sent)  # Redis ran the call...
        raise redis.ConnectionError("lost")  # ...its answer never came

    monkeypatch.setattr(sink._direct, "receive", lost)

    def delta(seq: int, text: str | None = "t") -> Streamed:
        return Streamed("g", seq, text, 60, None, "msgpack", tokens=1, model="m", life=life)

    sink.stream_now([delta(1), delta(2)])
    # When the writer thread writes them again, then the stream's end
    sink.stream([delta(3, None)])
    sink.start()
    sink.close(5)
    # Then each seq is in the stream once: a reader sees no restart
    entries = [f for _, f in r.xrange(KEYS.tokens("g"))]
    assert [(f[b"life"], f[b"seq"]) for f in entries] == [(b"1", b"1"), (b"1", b"2"), (b"1", b"3")]


def test_deltas_sent_at_once_read_the_last_answer_before_they_send(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    streams = ModelStreams(r, MODEL, 3, "w")
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)
    calls: list[str] = []
    send, receive = sink._direct.send, sink._direct.receive
    monkeypatch.setattr(sink._direct, "send", lambda items: calls.append("send") or send(items))
    monkeypatch.setattr(sink._direct, "receive", lambda s: calls.append("receive") or receive(s))

    def delta(seq: int) -> Streamed:
        return Streamed("g", seq, "t", 60, None, "msgpack", tokens=1, model="m")

    for seq in (1, 2, 3):
        sink.stream_now([delta(seq)])
    assert calls == ["send", "receive", "send", "receive", "send"]  # the last one unread
    sink.start()
    sink.close(5)  # reads it, and gives the connection back clean
    assert calls[-1] == "receive"
    assert [f[b"seq"] for _, f in r.xrange(KEYS.tokens("g"))] == [b"1", b"2", b"3"]
    assert r.ping()


def test_the_writer_thread_reads_the_answer_to_deltas_sent_at_once_right_away(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (so the device thread's next write has no answer to read before it sends: a read
    # there gave the GIL away, and a saturated worker's other threads kept it for ms)
    streams = ModelStreams(r, MODEL, 3, "w")
    sink = RedisSink(streams, Observers([]), lambda: None, dead_letter_maxlen=100)
    readers: list[str] = []
    read = threading.Event()
    receive = sink._direct.receive

    def reading(sent: Sent) -> None:
        receive(sent)
        readers.append(threading.current_thread().name)
        read.set()

    monkeypatch.setattr(sink._direct, "receive", reading)

    def delta(seq: int) -> Streamed:
        return Streamed("g", seq, "t", 60, None, "msgpack", tokens=1, model="m")

    sink.start()
    # When the device thread sends deltas at once and goes on
    sink.stream_now([delta(1)])
    # Then the writer thread reads their answer without being handed anything...
    assert read.wait(5)
    assert readers == ["sink"]
    # ...so the next deltas are sent with no answer left to read first
    read.clear()
    sink.stream_now([delta(2)])
    assert read.wait(5)
    sink.close(5)
    assert readers == ["sink", "sink"]
    assert [f[b"seq"] for _, f in r.xrange(KEYS.tokens("g"))] == [b"1", b"2"]
