"""Dead-letter replay goes through the replay script: it respects the lane's max depth."""

from __future__ import annotations

import json

import pytest
import redis
from batchfleet.schemas.codec import encode_request
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Request
from batchfleet.worker.streams import ModelStreams

from batchfleet import cli, dlq

MODEL = "tiny"
KEYS = ModelKeys(MODEL)


def dead_letters(r: redis.Redis, count: int, lane: int = 1) -> list[str]:
    """``count`` requests read by a worker and dead-lettered, as a worker does it."""
    streams = ModelStreams(r, MODEL, 3, "w")
    streams.ensure_groups()
    for i in range(count):
        r.xadd(KEYS.lane(lane), encode_request(Request(id=f"dead-{i}", model=MODEL, inputs=["x"])))
    for entry in streams.read({lane: count}, None):
        streams.dead_letter(entry, "poisoned", "test", "w", 100)
    return [d.id for d in dlq.list_dead(r, MODEL)]


def test_replay_into_a_full_lane_is_refused_and_partial_replay_fills_it(
    r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given three dead letters from lane 1, whose max depth is 2 and which holds 1 entry
    ids = dead_letters(r, 3)
    r.set(KEYS.max_depth, 2)
    r.xadd(KEYS.lane(1), encode_request(Request(id="queued", model=MODEL, inputs=["y"])))

    # When all are replayed
    report = dlq.replay(r, MODEL)

    # Then one goes back (the lane is full at 2), the others stay dead letters and say why
    assert report.replayed == ids[:1]
    assert list(report.refused) == ids[1:]
    assert all("lane 1 is full" in why and ">= 2" in why for why in report.refused.values())
    assert r.xlen(KEYS.lane(1)) == 2
    assert [d.id for d in dlq.list_dead(r, MODEL)] == ids[1:]

    # and the CLI says so and exits 1
    assert cli.main(["dlq", "replay", MODEL, "--all", "--redis-url", redis_url]) == 1
    out = capsys.readouterr().out
    assert "replayed 0" in out and "refused 2" in out and "stays a dead letter" in out

    # With room again (a deeper limit) the rest goes back
    r.set(KEYS.max_depth, 10)
    assert dlq.replay(r, MODEL).replayed == ids[1:]
    assert r.xlen(KEYS.dead) == 0 and r.xlen(KEYS.lane(1)) == 4


def test_replay_keeps_answered_requests_unless_forced(r: redis.Redis) -> None:
    (dead_id,) = dead_letters(r, 1, lane=2)
    r.set(KEYS.result("dead-0"), b"an old result")
    assert dlq.replay(r, MODEL).skipped == [dead_id]
    assert r.get(KEYS.result("dead-0")) == b"an old result"
    assert dlq.replay(r, MODEL, [dead_id], force=True).replayed == [dead_id]
    assert r.get(KEYS.result("dead-0")) is None and r.xlen(KEYS.lane(2)) == 1


def test_list_json_has_full_ids(
    r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = dead_letters(r, 2)
    assert cli.main(["dlq", "list", MODEL, "--json", "--redis-url", redis_url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["id"] for d in listed] == ids
    assert listed[0]["request_id"] == "dead-0" and listed[0]["source"] == KEYS.lane(1)


def test_entries_that_cannot_go_back_are_refused_with_the_reason(r: redis.Redis) -> None:
    elsewhere = r.xadd(KEYS.dead, {"source": "bf:{other}:lane:0", "orig_json": "{}"}).decode()
    empty = r.xadd(KEYS.dead, {"source": KEYS.lane(0), "code": "malformed"}).decode()
    report = dlq.replay(r, MODEL)
    assert report.replayed == [] and set(report.refused) == {elsewhere, empty}
    assert "is not a lane of 'tiny'" in report.refused[elsewhere]
    assert "no original entry" in report.refused[empty]
    assert r.xlen(KEYS.dead) == 2
