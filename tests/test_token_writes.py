"""The device thread's delta writes: ``tokens.lua`` calls packed by hand and sent on a
connection of their own write what the client's call writes (real redis-server)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import redis
from batchfleet.worker.deltas import StreamTo
from batchfleet.worker.streamed import EXPIRE_EVERY, Streamed
from batchfleet.worker.streams import ModelStreams
from batchfleet.worker.token_stream import TOKENS_CHUNK, TokenWrite
from batchfleet.worker.token_writes import TokenWrites


@pytest.fixture
def writes(redis_url: str) -> Iterator[TokenWrites]:
    w = TokenWrites(ModelStreams(redis.Redis.from_url(redis_url), "m-1", 3, "c1"))
    yield w
    w.close()


def _items(rid: str, texts: list[str], reply: str | None, json_: bool) -> list[TokenWrite]:
    out = [TokenWrite(rid, i + 1, 60 if i == 0 else 0, t, i % 2, i + 1, reply, json_, "m-1")
           for i, t in enumerate(texts)]  # fmt: skip
    return [*out, TokenWrite(rid, len(texts) + 1, 120)]  # and the stream's end


def _subscribed(r: redis.Redis, *channels: str) -> Any:
    """A pub/sub connection subscribed to these channels, their confirmations read."""
    sub = r.pubsub()
    sub.subscribe(*channels)
    for _ in channels:
        sub.get_message(timeout=1)
    return sub


def _stream(r: redis.Redis, streams: ModelStreams, rid: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in r.xrange(streams.keys.tokens(rid))]


@pytest.mark.parametrize("json_", [False, True])
def test_writes_the_entries_and_messages_the_clients_call_writes(
    writes: TokenWrites, r: redis.Redis, json_: bool
) -> None:
    streams = writes.streams
    texts = ['say "hi"\n', "Zürich ☃ 😀", "x" * 32, "é" * 200, ""]
    sub = _subscribed(r, "chan-a", "chan-b")
    # Given the same deltas (unusual ids and texts) written both ways
    streams.append_tokens(_items("id {a}:1", texts, "chan-a", json_))
    writes.append(_items("id {b}:ü", texts, "chan-b", json_))
    # Then the token streams hold the same entries...
    assert _stream(r, streams, "id {b}:ü") == _stream(r, streams, "id {a}:1")
    assert len(_stream(r, streams, "id {b}:ü")) == len(texts) + 1
    # ...with the same TTL set...
    assert 115 <= r.ttl(streams.keys.tokens("id {b}:ü")) <= 120
    # ...and the same messages went out, in order, but for their id
    got: dict[str, list[dict[str, object]]] = {"chan-a": [], "chan-b": []}
    while (m := sub.get_message(timeout=1)) is not None:
        if m["type"] == "message":
            body = json.loads(m["data"]) if json_ else msgpack.unpackb(m["data"])
            got[m["channel"].decode()].append({**body, "id": "-"})
    assert got["chan-b"] == got["chan-a"] and len(got["chan-b"]) == len(texts)
    sub.close()


def test_a_write_over_the_chunk_size_is_written_whole_in_order(
    writes: TokenWrites, r: redis.Redis
) -> None:
    items = [TokenWrite(f"r{i % 3}", i // 3 + 1, 0, f"t{i}") for i in range(TOKENS_CHUNK * 2 + 5)]
    writes.append(items)
    for rid in ("r0", "r1", "r2"):
        seqs = [int(f[b"seq"]) for f in _stream(r, writes.streams, rid)]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 2 * TOKENS_CHUNK // 3


def test_a_flushed_script_is_loaded_again_and_the_write_made_once(
    writes: TokenWrites, r: redis.Redis
) -> None:
    writes.append([TokenWrite("a", 1, 0, "x")])
    r.script_flush()  # as a restarted Redis would have it
    writes.append([TokenWrite("a", 2, 0, "y")])
    assert [f[b"seq"] for f in _stream(r, writes.streams, "a")] == [b"1", b"2"]


def test_a_killed_connection_fails_one_write_at_most_and_never_misreads(
    writes: TokenWrites, r: redis.Redis
) -> None:
    writes.append([TokenWrite("a", 1, 0, "x")])
    r.client_kill_filter(_type="normal", skipme=True)  # every client but this one
    with contextlib.suppress(redis.ConnectionError):
        writes.append([TokenWrite("a", 2, 0, "y")])
    writes.append([TokenWrite("a", 3, 0, "z")])
    writes.append([TokenWrite("a", 4, 0, "w")])
    seqs = [f[b"seq"] for f in _stream(r, writes.streams, "a")]
    assert seqs in ([b"1", b"3", b"4"], [b"1", b"2", b"3", b"4"])


def test_an_error_reply_is_raised_and_the_connection_stays_usable(
    writes: TokenWrites, r: redis.Redis
) -> None:
    key = writes.streams.keys.tokens("a")
    r.set(key, "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        writes.append([TokenWrite("a", 1, 0, "x")])
    r.delete(key)
    writes.append([TokenWrite("a", 1, 0, "x")])
    assert [f[b"seq"] for f in _stream(r, writes.streams, "a")] == [b"1"]


def test_close_gives_the_connection_back(writes: TokenWrites) -> None:
    pool = writes.streams.client.connection_pool
    writes.append([TokenWrite("a", 1, 0, "x")])
    assert len(pool._in_use_connections) == 1
    writes.close()
    assert not pool._in_use_connections
    writes.append([TokenWrite("a", 2, 0, "y")])  # a later write takes one again
    assert len(pool._in_use_connections) == 1


def test_close_never_gives_back_a_connection_with_an_answer_unread(writes: TokenWrites) -> None:
    # redis-py drops a pooled connection with data to read when it is taken, but an answer
    # still on its way then would be read by the pool's next user as its own
    writes.send([TokenWrite("a", 1, 0, "x")])  # its answer never read
    conn = writes._conn
    writes.close()
    assert conn._sock is None  # dropped, not given back connected
    assert writes.streams.client.xlen(writes.streams.keys.tokens("a")) == 1


def test_an_earlier_attempt_writes_nothing_once_a_later_one_has_written(
    writes: TokenWrites, r: redis.Redis
) -> None:
    # Given a request's first attempt (life 1) streaming, then taken over by another worker
    # (life 2) that starts again at seq 1, while the first goes on a little (it stalled)
    streams = writes.streams
    sub = r.pubsub()
    sub.subscribe("chan")
    sub.get_message(timeout=1)

    def write(life: int, seq: int, text: str | None) -> None:  # checked: negative life
        writes.append([TokenWrite("q", seq, 0, text, reply="chan", life=-life)])

    write(1, 1, "a")
    write(1, 2, "b")
    write(2, 1, "A")  # the new owner's first delta
    write(1, 3, "c")  # the stalled first attempt resumes: refused...
    write(1, 4, None)  # ...its end too
    write(2, 2, "B")
    write(2, 3, None)
    # Then the stream holds the first attempt up to the takeover, then only the second's,
    # each entry with its life first; the refused deltas were not published either
    entries = _stream(r, streams, "q")
    assert [(e[b"life"], e[b"seq"], e.get(b"text", b"END")) for e in entries] == [
        (b"1", b"1", b"a"), (b"1", b"2", b"b"), (b"2", b"1", b"A"), (b"2", b"2", b"B"),
        (b"2", b"3", b"END"),
    ]  # fmt: skip
    assert all(next(iter(e)) == b"life" for e in entries)
    texts = []
    while (m := sub.get_message(timeout=0.5)) is not None:
        if m["type"] == "message":
            texts.append(msgpack.unpackb(m["data"])["text"])
    assert texts == ["a", "b", "A", "B"]
    sub.close()
    # An unchecked write (positive life) is not refused; one without a life writes none
    writes.append([TokenWrite("q", 5, 0, "y", life=1)])
    assert _stream(r, streams, "q")[-1][b"life"] == b"1"
    writes.append([TokenWrite("q", 6, 0, "z")])
    assert b"life" not in _stream(r, streams, "q")[-1]


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_streamed_deltas_write_what_their_token_writes_write(
    writes: TokenWrites, r: redis.Redis, fmt: str
) -> None:
    streams = writes.streams
    sub = _subscribed(r, "chan-a", "chan-b")

    def made(rid: str, reply: str) -> list[Streamed]:
        to = StreamTo("0-1", rid, "m-1", 90, reply, fmt, life=2)  # type: ignore[arg-type]
        # plain deltas (the 1st and 65th set the TTL), one with optional fields, the end
        chunks = [{"input": 0, "text": f"t{k} ", "tokens": 1} for k in range(EXPIRE_EVERY + 1)]
        chunks.insert(3, {"input": 1, "text": "é", "tokens": 2, "token_ids": [5, 6]})
        out = [to.delta(seq, c) for seq, c in enumerate(chunks, 1)]
        return [*out, to.delta(len(out) + 1, None)]

    # Given the same deltas written as Streamed items (plain ones packed without a
    # TokenWrite) and as their TokenWrites
    direct = made("id-b", "chan-b")
    assert sum(it.plain for it in direct) == EXPIRE_EVERY + 1
    writes.append(direct[:-1])
    assert 85 <= r.ttl(streams.keys.tokens("id-b")) <= 90  # (set by the deltas, before the end)
    writes.append(direct[-1:])
    writes.append([it.write() for it in made("id-a", "chan-a")])
    # Then the token streams hold the same entries and the same messages went out
    assert _stream(r, streams, "id-b") == _stream(r, streams, "id-a")
    got: dict[str, list[dict[str, object]]] = {"chan-a": [], "chan-b": []}
    while (m := sub.get_message(timeout=1)) is not None:
        if m["type"] == "message":
            body = json.loads(m["data"]) if fmt == "json" else msgpack.unpackb(m["data"])
            got[m["channel"].decode()].append({**body, "id": "-"})
    assert got["chan-b"] == got["chan-a"] and len(got["chan-b"]) == EXPIRE_EVERY + 2
    sub.close()


class _Padded:
    """A plain delta's item with an empty ``more`` appended: ``tokens.lua`` then takes its
    general branch, which must write what the plain branch writes."""

    def __init__(self, write: TokenWrite) -> None:
        self.request_id = write.request_id
        self._item = write.item()

    def item(self) -> list[object]:
        return [*self._item, []]


@pytest.mark.parametrize("json_", [False, True])
@pytest.mark.parametrize("life", [0, 3, -3])
def test_a_plain_delta_s_branch_writes_what_the_general_one_writes_byte_for_byte(
    writes: TokenWrites, r: redis.Redis, json_: bool, life: int
) -> None:
    streams = writes.streams
    sub = _subscribed(r, "chan-a", "chan-b")
    texts = ['say "hi"\n', "Zürich ☃ 😀", "x" * 32, "é" * 200, ""]

    def made(rid: str, reply: str) -> list[TokenWrite]:  # the 1st sets the TTL
        return [TokenWrite(rid, i + 1, 60 if i == 0 else 0, t, i % 2, i + 1, reply, json_,
                           "m-1", life=life) for i, t in enumerate(texts)]  # fmt: skip

    # Given the same deltas, plain (10 fields) and with an empty list of optional fields
    plain = made("id-b", "chan-b")
    assert all(len(it.item()) == 10 for it in plain)
    writes.append(plain)
    writes.append([_Padded(it) for it in made("id-a", "chan-a")])
    # Then the streams hold the same fields in the same order, with the same TTL...
    assert _stream(r, streams, "id-b") == _stream(r, streams, "id-a")
    assert [list(e) for e in _stream(r, streams, "id-b")] == [
        list(e) for e in _stream(r, streams, "id-a")
    ]
    assert 55 <= r.ttl(streams.keys.tokens("id-b")) <= 60
    # ...and the messages are the same bytes, but for the request's id
    raw: dict[str, list[bytes]] = {"chan-a": [], "chan-b": []}
    while (m := sub.get_message(timeout=0.5)) is not None:
        if m["type"] == "message":
            raw[m["channel"].decode()].append(m["data"])
    assert len(raw["chan-b"]) == len(texts)
    assert raw["chan-b"] == [m.replace(b"id-a", b"id-b") for m in raw["chan-a"]]
    sub.close()
