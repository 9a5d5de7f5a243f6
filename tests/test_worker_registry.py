"""What a worker publishes of itself beside its heartbeat (its Celery hostname, what it
serves the model with: ``bf:{model}:hostnames``, ``bf:{model}:serving``), against a real
Redis: written with each beat, removed as it stops, pruned by the others once its heartbeat
is gone; and each worker judged live by its own heartbeat timeout."""

from __future__ import annotations

import asyncio

import pytest
import redis
from batchfleet.producer.gateway import fleet_control
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Limits
from batchfleet.schemas.model_info import ModelInfo, WorkerServing, decode_worker_serving
from batchfleet.worker.intake import Intake
from batchfleet.worker.registry import Pruned
from batchfleet.worker.streams import ModelStreams
from batchfleet.worker.takeover import PRUNE_EVERY_S

from batchfleet import control_wait
from batchfleet.config import WorkerConfig
from batchfleet.connection import connect_async

MODEL = "tiny"
KEYS = ModelKeys(MODEL)
HASH = "0123456789abcdef" * 4
HOUR_MS = 3_600_000


def entries(r: redis.Redis) -> tuple[set[str], set[str], set[str]]:
    """The consumers named in the heartbeat, hostname and serving hashes."""
    return tuple({k.decode() for k in r.hkeys(key)}  # type: ignore[return-value]
                 for key in (KEYS.workers, KEYS.hostnames, KEYS.serving))  # fmt: skip


def test_hostname_and_serving_ride_each_heartbeat_and_go_when_the_worker_stops(
    r: redis.Redis,
) -> None:
    # Given a worker that said who it is, and another worker's entries
    streams = ModelStreams(r, MODEL, 1, "w1")
    card = WorkerServing(version="1.0", config_hash=HASH, heartbeat_timeout_ms=5000)
    streams.identify(hostname="celery@h1", serving=card)
    r.hset(KEYS.workers, "w2", 1)
    r.hset(KEYS.hostnames, "w2", "w2@h2")
    # When it beats, Then both are published beside its heartbeat
    streams.heartbeat(1000)
    assert r.hget(KEYS.hostnames, "w1") == b"celery@h1"
    assert decode_worker_serving(r.hget(KEYS.serving, "w1") or b"") == card
    # removed by another worker (it was silent past the timeout): back at its next beat
    r.hdel(KEYS.hostnames, "w1")
    r.hdel(KEYS.serving, "w1")
    streams.heartbeat(2000)
    assert entries(r) == ({"w1", "w2"}, {"w1", "w2"}, {"w1"})
    # When it stops, Then its three entries go and the other worker's stay
    streams.unregister()
    assert entries(r) == ({"w2"}, {"w2"}, set())


def test_pruning_removes_the_entries_of_workers_whose_heartbeat_is_gone(r: redis.Redis) -> None:
    # Given a live worker, one silent past the timeout, one silent exactly that long, one
    # that left entries without a heartbeat (died before its first beat: an old worker),
    # and one silent past the pruner's timeout but within its own longer one
    now, timeout = 1_000_000, 6000
    r.hset(KEYS.workers, mapping={"live": now - 900, "dead": now - timeout - 1,
                                  "edge": now - timeout, "patient": now - 10_000})  # fmt: skip
    for name in ("live", "dead", "edge", "gone", "patient"):
        r.hset(KEYS.hostnames, name, f"{name}@h")
        r.hset(KEYS.serving, name, "not JSON" if name == "dead" else "{}")
    r.hset(KEYS.serving, "patient", WorkerServing(heartbeat_timeout_ms=20_000).model_dump_json())
    # When a worker prunes
    pruned = ModelStreams(r, MODEL, 1, "w1").prune(now, timeout, HOUR_MS)
    # Then the dead one's and the heartbeat-less one's entries went (the heartbeat hash
    # keeps it within the retention: status shows stale workers), the others' stay
    assert pruned == Pruned(entries=4, heartbeats=0, consumers=0)
    kept = {"live", "edge", "patient"}
    assert entries(r) == (kept | {"dead"}, kept, kept)


def test_pruning_forgets_heartbeats_older_than_the_retention(r: redis.Redis) -> None:
    # Given workers silent for: a second, ten minutes (stale), exactly the retention, just
    # past it, past it but within its own longer heartbeat timeout; and the pruner, whose
    # own beat looks ancient (a clock far off): never removed by itself
    now, timeout = 10 * HOUR_MS, 6000
    r.hset(KEYS.workers, mapping={
        "live": now - 1000, "stale": now - 600_000, "edge": now - HOUR_MS,
        "gone": now - HOUR_MS - 1, "patient": now - HOUR_MS - 1, "w1": 0,
    })  # fmt: skip
    card = WorkerServing(heartbeat_timeout_ms=2 * HOUR_MS).model_dump_json()
    r.hset(KEYS.serving, "patient", card)
    # When a worker prunes
    pruned = ModelStreams(r, MODEL, 1, "w1").prune(now, timeout, HOUR_MS)
    # Then only the heartbeat past both the retention and its timeout went
    assert pruned.heartbeats == 1
    assert entries(r)[0] == {"live", "stale", "edge", "patient", "w1"}


def read_as(r: redis.Redis, consumer: str, lanes: int, ack: bool) -> list[str]:
    """``consumer`` reads one new entry from each lane (acking it, if ``ack``); their ids."""
    streams = ModelStreams(r, MODEL, lanes, consumer)
    streams.ensure_groups()
    ids = []
    for lane in range(lanes):
        r.xadd(KEYS.lane(lane), {"r": consumer})
        (entry,) = streams.read({lane: 1}, None)
        if ack:
            r.xack(KEYS.lane(lane), GROUP, entry.id)
        ids.append(entry.id)
    return ids


def consumers(r: redis.Redis, lanes: int) -> list[set[str]]:
    """Each lane group's consumer names."""
    return [{c["name"].decode() for c in r.xinfo_consumers(KEYS.lane(lane), GROUP)}
            for lane in range(lanes)]  # fmt: skip


def test_pruning_deletes_dead_consumers_only_once_they_hold_nothing(r: redis.Redis) -> None:
    # Given three lanes read by: a dead worker that answered all it read, one that died
    # holding an entry on each lane, one that died long ago and read lane 0 only (its
    # heartbeat already forgotten), a live worker, and the pruner
    lanes, now, timeout = 3, 10 * HOUR_MS, 6000
    read_as(r, "done", lanes, ack=True)
    held = read_as(r, "holding", lanes, ack=False)
    read_as(r, "forgotten", 1, ack=True)
    read_as(r, "live", lanes, ack=True)
    read_as(r, "w1", lanes, ack=True)
    dead = now - HOUR_MS - 1
    r.hset(KEYS.workers, mapping={"done": dead, "holding": dead, "live": now - 1000, "w1": 0})
    pruner = ModelStreams(r, MODEL, lanes, "w1")
    everyone = {"done", "holding", "forgotten", "live", "w1"}
    # When a worker prunes while they were idle less than the retention (just read)
    pruned = pruner.prune(now, timeout, HOUR_MS)
    # Then no consumer goes (the dead heartbeats do)
    assert pruned == Pruned(entries=0, heartbeats=2, consumers=0)
    assert consumers(r, lanes) == [everyone, everyone - {"forgotten"}, everyone - {"forgotten"}]
    # When they were idle long enough (a retention of 0: any idle time is enough)
    pruned = pruner.prune(now, timeout, 0)
    # Then the dead consumers that hold nothing go from every lane; the one holding
    # entries stays with them intact, as do the live worker and the pruner
    assert pruned.consumers == lanes + 1
    assert consumers(r, lanes) == [{"holding", "live", "w1"}] * lanes
    for lane in range(lanes):
        (pending,) = r.xpending_range(KEYS.lane(lane), GROUP, "-", "+", 10)
        assert (pending["message_id"].decode(), pending["consumer"]) == (held[lane], b"holding")
    # When the takeover moved its entries to a live worker
    for lane in range(lanes):
        r.xclaim(KEYS.lane(lane), GROUP, "live", 0, [held[lane]])
    # Then the next prune deletes it too
    assert pruner.prune(now, timeout, 0).consumers == lanes
    assert consumers(r, lanes) == [{"live", "w1"}] * lanes


def test_a_refused_prune_is_logged_and_the_takeover_goes_on(
    redis_url: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a worker whose ACL user may not XINFO (an ACL written before the prune used
    # it), and an entry held by a dead worker, idle past the heartbeat timeout
    r.acl_setuser("no-xinfo", enabled=True, passwords=["+pw"], categories=["+@all"],
                  commands=["-xinfo"], keys=["*"], channels=["*"])  # fmt: skip
    try:
        client = redis.Redis.from_url(redis_url, username="no-xinfo", password="pw")
        (held,) = read_as(r, "gone", 1, ack=False)
        r.xclaim(KEYS.lane(0), GROUP, "gone", 0, [held], idle=60_000)
        streams = ModelStreams(client, MODEL, 1, "w1")
        intake = Intake(streams, WorkerConfig(heartbeat_timeout_ms=2000), Limits(),
                        lambda: 1_000.0, print)  # fmt: skip
        # When its takeover pass prunes first (the refusal's wording varies by server: "can't
        # run this command" in a script on some, "no permissions to run" on Valkey 8.1)
        refused = r"can't run this command|no permissions to run"
        with pytest.raises(redis.ResponseError, match=refused):
            streams.prune(1_000_000, 2000, HOUR_MS)
        found = intake._takeover.take(1_000.0, 10, True)
        # Then the refusal is logged and the dead worker's entry is taken over all the same
        assert "pruning dead workers failed" in caplog.text
        assert [e.id for e in found] == [held]
        client.close()
    finally:
        r.acl_deluser("no-xinfo")


def test_the_intake_publishes_its_serving_and_prunes_dead_workers_now_and_then(
    r: redis.Redis,
) -> None:
    # Given an intake on a clock in the test's hands (unix seconds), a worker that died
    # long ago and one that beats
    now = [1_000.0]
    streams = ModelStreams(r, MODEL, 1, "w1")
    streams.identify(hostname="w1@h")
    info = ModelInfo(task="embedding", version="9.9", config_hash=HASH)
    worker = WorkerConfig(heartbeat_timeout_ms=2000, dead_worker_retention_s=60)
    intake = Intake(streams, worker, Limits(), lambda: now[0], print, info=info)
    r.hset(KEYS.workers, mapping={"old": 900_000, "busy": 999_500})
    for name in ("old", "busy"):
        r.hset(KEYS.hostnames, name, f"{name}@h")
        r.hset(KEYS.serving, name, "{}")
    # When it starts (its thread stopped at once: the test drives it)
    intake.start(None)
    intake.stop()
    intake.join(5)
    # Then its serving entry carries its version, hash and heartbeat timeout
    served = decode_worker_serving(r.hget(KEYS.serving, "w1") or b"")
    assert served == WorkerServing(version="9.9", config_hash=HASH, heartbeat_timeout_ms=2000)
    assert r.hget(KEYS.hostnames, "w1") == b"w1@h"
    # When its first takeover pass judges heartbeats (connected for a whole timeout)
    now[0] = 1_003.0
    r.hset(KEYS.workers, mapping={"w1": 1_003_000, "busy": 1_002_500})
    intake._takeover.take(now[0], 10, True)
    # Then the long-dead worker's entries are pruned, its heartbeat too (past the
    # retention), the live ones' kept
    assert entries(r) == ({"w1", "busy"}, {"w1", "busy"}, {"w1", "busy"})
    # and not again until PRUNE_EVERY_S passed
    now[0] += PRUNE_EVERY_S - 1
    r.hset(KEYS.workers, "w1", int(now[0] * 1000))
    intake._takeover.take(now[0], 10, True)
    assert "busy" in entries(r)[1]
    now[0] += 1
    r.hset(KEYS.workers, "w1", int(now[0] * 1000))
    intake._takeover.take(now[0], 10, True)
    assert entries(r)[1:] == ({"w1"}, {"w1"})


@pytest.mark.parametrize("side", ["cli", "gateway"])
def test_each_worker_is_judged_live_by_its_own_heartbeat_timeout(
    redis_url: str, r: redis.Redis, side: str
) -> None:
    # Given workers of one model on fleet-file entries with different heartbeat timeouts,
    # the last one started published 6 s as the model's
    seconds, micros = r.time()
    now = seconds * 1000 + micros // 1000
    r.set(KEYS.heartbeat_timeout, 6000)
    beats = {"slow": now - 10_000, "fast": now - 3000, "plain": now - 5000, "late": now - 7000}
    r.hset(KEYS.workers, mapping=beats)
    for name, own in (("slow", 20_000), ("fast", 2000)):
        card = WorkerServing(heartbeat_timeout_ms=own).model_dump_json()
        r.hset(KEYS.serving, name, card)
    r.hset(KEYS.serving, "plain", "not ours to read")

    def live(given_ms: int | None) -> list[str]:
        if side == "cli":
            return control_wait.live_workers(r, [MODEL], given_ms)[0]

        async def go() -> list[str]:
            client = connect_async(redis_url)
            try:
                return await fleet_control.live_workers(client, [MODEL], given_ms)
            finally:
                await client.aclose()

        return asyncio.run(go())

    # Then each is judged by its own timeout, else the model's; the operator's overrides
    assert live(None) == ["plain", "slow"]
    assert live(4000) == ["fast"]
    if side == "cli":  # the longest window applied, for the CLI's message
        assert control_wait.live_workers(r, [MODEL])[1] == 20_000
