"""A token stream that skips a ``seq`` (deltas a failed-over master acknowledged and lost:
``tests/test_cluster_failover_gen.py`` found it) is completed from the result: the
deltas before the gap as they came, then the rest of each output in one delta, so the
reader's text is the result's; where the result does not continue what was read (another
attempt's), a restart and its whole text. Both producers, a real Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator

import msgpack
import pytest
import redis
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Delta
from batchfleet.worker.streams import ModelStreams
from batchfleet.worker.token_stream import TokenWrite
from test_producer import Shell, collect, write_deltas

pytestmark = pytest.mark.timeout(60)

KEYS = ModelKeys("tiny")


@pytest.fixture(params=["sync", "async"])
def shell(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Shell]:
    made = Shell(str(request.param), redis_url)
    yield made
    made.close()


def store(client: redis.Redis, rid: str, text: str, tokens: int, **more: object) -> None:
    """A generation's result of one output, ``tokens`` long (``more``: its other fields)."""
    out = {"text": text, "finish_reason": "length", "prompt_tokens": 3,
           "completion_tokens": tokens, **more}  # fmt: skip
    body = {"v": 1, "id": rid, "model": "tiny", "status": "ok", "outputs": [out]}
    client.set(KEYS.result(rid), msgpack.packb(body))


def marks(events: list[Delta | Restarted]) -> list[object]:
    return [(d.seq, d.text, d.tokens) if isinstance(d, Delta) else "Restarted" for d in events]


def test_a_stream_that_skips_a_seq_is_completed_from_the_result(
    r: redis.Redis, shell: Shell
) -> None:
    middle, tail, other = shell.submit_many("tiny", ["a", "b", "c"], stream=True)
    # Given deltas 3-4 lost in the middle of a stream, and the last two of another
    write_deltas(r, middle.id, (1, "The "), (2, "cap"), (5, " is"), (6, " Paris"), end=7)
    store(r, middle.id, "The capital city is Paris", 6, token_ids=[10, 11, 12, 13, 14, 15])
    write_deltas(r, tail.id, (1, "Oui"), end=4)
    store(r, tail.id, "Oui, oui", 3)
    # Then a reader gets the deltas before the gap, then the rest from the result
    assert marks(collect(shell, middle.deltas())) == [
        (1, "The ", 1), (2, "cap", 1), (3, "ital city is Paris", 4)]  # fmt: skip
    (*_, rest) = collect(shell, middle.deltas())
    assert rest.token_ids == [12, 13, 14, 15]
    assert "".join(collect(shell, middle.stream())) == "The capital city is Paris"
    assert marks(collect(shell, tail.deltas())) == [(1, "Oui", 1), (2, ", oui", 2)]
    # and where the result is not the text read so far: a restart, then the result's text
    write_deltas(r, other.id, (1, "Yes"), (3, "!"), end=4)
    store(r, other.id, "No way", 2)
    assert marks(collect(shell, other.deltas())) == [(1, "Yes", 1), "Restarted", (1, "No way", 2)]


def _chunk(index: int, arguments: str, name: str | None = None) -> dict[str, object]:
    """A ``tool_call_chunks`` item: a call's first (``name`` set: its id ``call_<name>``)
    or a later piece."""
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _call(name: str, arguments: str) -> dict[str, object]:
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _joined(deltas: list[Delta]) -> dict[int, tuple[str | None, str | None, str]]:
    """Each streamed call as a client joins its chunks: index → (id, name, arguments)."""
    calls: dict[int, tuple[str | None, str | None, str]] = {}
    for d in deltas:
        for c in d.tool_call_chunks or ():
            cid, name, args = calls.get(c.index, (None, None, ""))
            calls[c.index] = (c.id or cid, c.function.name or name, args + c.function.arguments)
    return calls


def test_a_gap_in_streamed_tool_calls_is_completed_with_their_chunks(
    r: redis.Redis, shell: Shell
) -> None:
    (job,) = shell.submit_many("tiny", ["a"], stream=True)
    # Given a call begun (its name and part of its arguments), a call begun and left out
    # of the result (its index 1 kept), then deltas lost: the first call's rest, and a
    # third call whole
    seen = [(1, "<a>", [_chunk(0, '{"city": "Par', "weather")]),
            (2, "<b>", [_chunk(1, '{"x', "broken")]),
            (5, "<c>", [_chunk(2, '{"q": 1}', "time")])]  # fmt: skip
    writes = [TokenWrite(job.id, seq, 60, text, tokens=1, tool_call_chunks=json.dumps(chunks))
              for seq, text, chunks in seen]  # fmt: skip
    ModelStreams(r, "tiny", 3, "fake-worker").append_tokens([*writes, TokenWrite(job.id, 6, 60)])
    calls = [_call("weather", '{"city": "Paris"}'), _call("time", '{"q": 1}')]
    store(r, job.id, "<a><b><lost><c>", 5, tool_calls=calls)
    # When a reader reads the stream across the gap
    deltas = [d for d in collect(shell, job.deltas()) if isinstance(d, Delta)]
    # Then the chunks before the gap as they came, then one delta with the rest: the
    # first call's arguments under its index, the call never seen whole under index 2
    assert [d.seq for d in deltas] == [1, 2, 3]
    (rest,) = deltas[2:]
    assert [c.model_dump(exclude_none=True) for c in rest.tool_call_chunks or ()] == [
        _chunk(0, 'is"}'), _chunk(2, '{"q": 1}', "time")]  # fmt: skip
    joined = _joined(deltas)
    assert joined[0] == ("call_weather", "weather", '{"city": "Paris"}')
    assert joined[2] == ("call_time", "time", '{"q": 1}')
    assert [c["function"] for c in calls] == [  # type: ignore[index]
        {"name": n, "arguments": a} for _, n, a in (joined[0], joined[2])]  # fmt: skip
    assert [c.id for c in rest.tool_calls or ()] == ["call_weather", "call_time"]


def test_a_gap_after_every_chunk_adds_no_chunks(r: redis.Redis, shell: Shell) -> None:
    (job,) = shell.submit_many("tiny", ["a"], stream=True)
    # Given every chunk of the one call read, then a lost delta of plain text
    chunks = json.dumps([_chunk(0, '{"q": 1}', "time")])
    ModelStreams(r, "tiny", 3, "fake-worker").append_tokens([
        TokenWrite(job.id, 1, 60, "<c>", tokens=1, tool_call_chunks=chunks),
        TokenWrite(job.id, 3, 60)])  # fmt: skip
    store(r, job.id, "<c> done", 2, tool_calls=[_call("time", '{"q": 1}')])
    # Then the rest of the text comes without chunks
    deltas = [d for d in collect(shell, job.deltas()) if isinstance(d, Delta)]
    assert [(d.seq, d.text, d.tool_call_chunks) for d in deltas[1:]] == [(2, " done", None)]


def test_a_gap_after_the_whole_text_still_completes_the_calls(r: redis.Redis, shell: Shell) -> None:
    (job,) = shell.submit_many("tiny", ["a"], stream=True)
    # Given all the text and tokens read, and a last delta lost that added only the call
    # (its chunks and the whole call: what the whole text completes comes with the last)
    write_deltas(r, job.id, (1, "<c>"), end=3)
    store(r, job.id, "<c>", 1, tool_calls=[_call("time", "{}")])
    # Then the fill adds no text or tokens, but the call, whole and as chunks
    deltas = [d for d in collect(shell, job.deltas()) if isinstance(d, Delta)]
    (rest,) = deltas[1:]
    assert (rest.seq, rest.text, rest.tokens) == (2, "", 0)
    assert [c.id for c in rest.tool_calls or ()] == ["call_time"]
    assert [c.model_dump(exclude_none=True) for c in rest.tool_call_chunks or ()] == [
        _chunk(0, "{}", "time")]  # fmt: skip


def _lived(client: redis.Redis, rid: str, life: int, *deltas: tuple[int, str]) -> None:
    """Deltas of input 0 as attempt ``life`` appends them (unchecked: a failover's new
    master has no trace of the writes the old one took)."""
    writes = [TokenWrite(rid, seq, 60, text, tokens=1, life=life) for seq, text in deltas]
    ModelStreams(client, "tiny", 3, "fake-worker").append_tokens(writes)


def test_a_write_made_again_across_a_failover_is_read_once(r: redis.Redis, shell: Shell) -> None:
    again, restarted = shell.submit_many("tiny", ["a", "b"], stream=True)
    # Given a stream whose deltas 2-3 come again from the same attempt (its master took
    # them, failed over before the worker had the answer, and the promoted replica never
    # had them: the worker wrote them again), then the rest
    _lived(r, again.id, 1, (1, "The "), (2, "cap"), (3, "ital"))
    _lived(r, again.id, 1, (2, "cap"), (3, "ital"), (4, " is"))
    write_deltas(r, again.id, end=5)
    store(r, again.id, "The capital is", 4)
    # Then a reader gets each delta once, no restart
    assert marks(collect(shell, again.deltas())) == [
        (1, "The ", 1), (2, "cap", 1), (3, "ital", 1), (4, " is", 1)]  # fmt: skip
    assert "".join(collect(shell, again.stream())) == "The capital is"
    # And a seq again from a later attempt is still a restart
    _lived(r, restarted.id, 1, (1, "Yes"), (2, "!"))
    _lived(r, restarted.id, 2, (1, "No"))
    write_deltas(r, restarted.id, end=2)
    store(r, restarted.id, "No", 1)
    assert marks(collect(shell, restarted.deltas())) == [
        (1, "Yes", 1), (2, "!", 1), "Restarted", (1, "No", 1)]  # fmt: skip


def test_a_first_seq_again_from_the_same_life_is_a_restart(r: redis.Redis, shell: Shell) -> None:
    job = shell.submit("tiny", "a", stream=True)
    # Given a stream whose attempt stopped (SIGTERM) and handed the request back uncounted:
    # the next attempt writes from seq 1 with the same life
    _lived(r, job.id, 1, (1, "Yes"), (2, "!"), (3, "!"))
    _lived(r, job.id, 1, (1, "No"), (2, "pe"))
    write_deltas(r, job.id, end=3)
    store(r, job.id, "Nope", 2)
    # Then a reader sees the restart, then the new attempt whole
    assert marks(collect(shell, job.deltas())) == [
        (1, "Yes", 1), (2, "!", 1), (3, "!", 1), "Restarted", (1, "No", 1), (2, "pe", 1)]  # fmt: skip
