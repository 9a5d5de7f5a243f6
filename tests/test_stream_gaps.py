"""A token stream that skips a ``seq`` (deltas a failed-over master acknowledged and lost:
``tests/test_cluster_failover_gen.py`` found it) is completed from the result: the
deltas before the gap as they came, then the rest of each output in one delta, so the
reader's text is the result's; where the result does not continue what was read (another
attempt's), a restart and its whole text. Both producers, a real Redis."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
import redis
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Delta
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
