"""A Redis Cluster master ``kill -9``'d mid-run, its replica promoted: the fleet follows the
new topology and every request gets exactly one result. The replica is stopped for a
moment before the kill (``SIGSTOP``), so the writes the master acknowledged meanwhile are
lost with it, as asynchronous replication loses them: requests the producer added, results
a worker stored (with their ``XACK``), deliveries. Real processes: a 6-node cluster (a
replica per master), an encoder worker (its Celery broker a plain Redis), a producer. And
the two fixes it needed, each alone: the intake takes again what the sink acked and a
failover un-acked; a script call that reached no master is raised (retried), not returned."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sized
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.client import Job
from batchfleet.producer.gateway.readiness import Readiness
from batchfleet.schemas.codec import envelope_of
from batchfleet.schemas.errors import Unavailable
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.results import Result
from batchfleet.worker.streams import Entry, Pending
from batchfleet.worker.unseen import Unseen
from conftest import WorkerProcess
from failover_cluster import FailoverCluster, fleet_file, running_failover_cluster

from batchfleet.connection import connect, connect_async, run_script_calls
from batchfleet.redis_server import LocalRedis

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"
KEYS = ModelKeys(MODEL)
REQUESTS = 240
LOST_AT_LEAST = 3
"""Results the master stores while its replica is stopped (all lost with it)."""
ANSWERED_WITHIN_S = 60.0
"""The whole run's answers, from before the failover: far below the idle fallback
(``claim_idle_ms``, 600 s here), so a request whose finish was lost with the master is
answered again by its live worker, not by the fallback."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[FailoverCluster]:
    with running_failover_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def url(cluster: FailoverCluster) -> str:
    """The fleet's URL: a node the failover leaves alone."""
    return cluster.url_for(KEYS.lane(0))


@pytest.fixture
def worker(
    url: str, redis_server: LocalRedis, tiny_embedder: Path, tmp_path: Path
) -> Iterator[WorkerProcess]:
    config = fleet_file(tmp_path / "fleet.toml", url, redis_server.url, {
        MODEL: {"runner": "embedding", "path": str(tiny_embedder), "max_tokens": 64,
                "lanes": 1, "batch": {"max_batch_size": 8, "max_wait_ms": 5}}})  # fmt: skip
    w = WorkerProcess(config, "fw0", tmp_path / "fw0.log")
    client = connect(url)
    try:
        w.wait_ready(client, MODEL)
        yield w
    finally:
        client.close()
        assert w.stop() == 0


def _keys(port: int, pattern: str) -> set[bytes]:
    with redis.Redis(port=port) as node:
        return set(node.keys(pattern))


def test_a_master_killed_mid_run_loses_no_request_and_answers_each_once(
    cluster: FailoverCluster, url: str, worker: WorkerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    texts = {f"req-{i}": f"the failover {i}" for i in range(REQUESTS)}
    ids = list(texts)
    producer = Producer(url)
    hasty = Producer(url, retry_for_s=0.5)
    assert hasty.lanes(MODEL) == 1  # (cached: its submit goes straight to the lane)
    gateway = connect_async(url)
    readiness = Readiness(gateway)
    loop = asyncio.new_event_loop()
    assert loop.run_until_complete(readiness.unready()) is None

    def submit(batch: list[str]) -> None:  # (retries through the failover: retry_for_s)
        for rid in batch:
            producer.submit(MODEL, texts[rid], request_id=rid, priority=0)

    # Given requests submitted, a worker answering them, and the producer waiting for all
    # on its reply channel (subscribed before the failover: it resubscribes and sweeps)
    third = REQUESTS // 3
    submit(ids[:third])
    answers: list[Result] = []
    jobs = [Job(rid, MODEL, producer) for rid in texts]
    waiter = threading.Thread(
        target=lambda: answers.extend(producer.results(jobs, timeout=ANSWERED_WITHIN_S))
    )
    waiter.start()
    master = cluster.owner(KEYS.lane(0))
    results = f"{KEYS.result('')}*"
    _poll_len(lambda: _keys(master, results), third // 4)
    lost: set[bytes] = set()

    def cut() -> None:  # the master acknowledges submits, deliveries and results, alone
        before = _keys(master, results)
        submit(ids[third : 2 * third])
        _poll_len(lambda: _keys(master, results) - before, LOST_AT_LEAST, timeout=1.0)
        lost.update(_keys(master, results) - before)

    failed: list[BaseException] = []

    def feed() -> None:
        try:
            submit(ids[2 * third :])
        except BaseException as exc:
            failed.append(exc)

    feeder = threading.Thread(target=feed)

    def dead() -> None:
        # a submit that cannot reach the slot's master gives up after retry_for_s, naming
        # the request whose outcome is unknown (not a raw connection error)
        with hasty, pytest.raises(Unavailable) as gave_up:
            hasty.submit(MODEL, "in a hurry", request_id="hasty", priority=0)
        assert gave_up.value.unknown_ids == ["hasty"]
        # and one that meets the dead master retries until the replica takes over
        caplog.clear()
        feeder.start()
        _poll_len(lambda: [r for r in caplog.records if "unreachable" in r.message] or failed, 1)

    # When the master of the model's slot dies with writes its replica never received,
    # more requests are submitted before its replica is promoted (the slot map still
    # names the dead master), and the replica takes over
    failover = cluster.kill_master_of(KEYS.lane(0), cut_replica=cut, while_dead=dead)
    cluster.promoted(failover, KEYS.lane(0))
    feeder.join(30)
    assert not failed and not feeder.is_alive()
    assert len(lost) >= LOST_AT_LEAST, "results stored while the replica was cut off"

    # Then the producer resubmits what the new master never received (its acknowledged
    # XADD lost with the master: docs/reliability.md, "Cluster failover"), with the same ids
    never_received = [rid for rid in ids if rid not in _known(failover.heir)]
    submit(never_received)
    # and every request is answered once, by its live worker, long before the fallback
    waiter.join(ANSWERED_WITHIN_S + 5)
    producer.close()
    assert sorted(r.id for r in answers) == sorted(texts)
    assert all(r.ok and len(r.outputs[0]) == 32 for r in answers)
    with redis.Redis(port=failover.heir) as heir:
        _poll_len(lambda: [] if heir.xpending(KEYS.lane(0), GROUP)["pending"] else [1], 1)
        assert heir.xpending(KEYS.lane(0), GROUP)["pending"] == 0
        # (each result stored on the new master, the lost ones again: a reader finds it)
        assert [rid for rid in texts if not heir.exists(KEYS.result(rid))] == []
        assert heir.xlen(KEYS.dead) == 0
    assert worker.alive()
    # and the gateway's readiness pings the new set of masters
    _poll_len(lambda: [1] if loop.run_until_complete(readiness.unready()) is None else [], 1)
    assert loop.run_until_complete(readiness.unready()) is None
    loop.run_until_complete(gateway.aclose())
    loop.close()


def _known(port: int) -> set[str]:
    """The ids of the requests a node holds: queued on the lane, or answered."""
    with redis.Redis(port=port) as node:
        entries = node.xrange(KEYS.lane(0))
        stored = node.keys(f"{KEYS.result('')}*")
    queued = {envelope_of(fields).id for _, fields in entries}
    return {k.decode().removeprefix(KEYS.result("")) for k in stored} | {
        rid for rid in queued if rid is not None
    }


def _poll_len(get: Callable[[], Sized], at_least: int, timeout: float = 60.0) -> None:
    """Wait until ``get()`` holds ``at_least`` items (up to ``timeout``: a cut of the
    replica is bounded below the node timeout, whatever it reached)."""
    end = time.monotonic() + timeout
    while len(get()) < at_least and time.monotonic() < end:
        time.sleep(0.01)


class _Pipeline:
    """A cluster pipeline's answer when a master is dead: redis-py hands the connection
    error back as the reply (``raise_on_error=False``) once its own retries are spent."""

    def __init__(self, replies: list[object]) -> None:
        self.replies = replies

    def execute_command(self, *args: object) -> None: ...

    def evalsha(self, *args: object) -> None: ...

    def execute(self, raise_on_error: bool = True) -> list[object]:
        return self.replies


class _Client:
    def __init__(self, replies: list[object]) -> None:
        self.replies = replies

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self.replies)


def test_a_script_call_that_reached_no_master_raises_for_the_retry() -> None:
    script = redis.Redis().register_script("return 1")  # (never connects)
    down = redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    # a call whose master is dead, beside one that went through: the caller retries both
    with pytest.raises(redis.ConnectionError):
        run_script_calls(_Client([b"1-0", down]), script, [([KEYS.lane(0)], [])] * 2)
    # an error Redis answered is the call's reply (QUEUEFULL: the producer reads it)
    full = redis.ResponseError("QUEUEFULL bf:{tiny}:lane:0 holds 5 >= 5")
    assert run_script_calls(_Client([full]), script, [([KEYS.lane(0)], [])]) == [full]


class _OwnPending:
    """A consumer's pending entries as ``XPENDING`` lists them (what ``Unseen.find`` reads)."""

    def __init__(self, pending: list[Pending]) -> None:
        self.pending = pending

    def own_pending(self, limit: int) -> list[Pending]:
        return self.pending[:limit]


def test_an_entry_acked_then_pending_again_is_taken_again_not_left_to_the_fallback() -> None:
    held, acked = Entry(0, "1-0", {}), Entry(0, "2-0", {})
    unseen = Unseen()
    unseen.posted([held, acked])
    # When the sink acks one (on the master that dies), then a failover loses the ack:
    # both are pending on this consumer again
    unseen.settled([acked])
    pending = [Pending(0, "1-0", 1, 5), Pending(0, "2-0", 1, 5)]
    # Then the look takes the acked one again; the one the loop still holds stays its own
    assert unseen.find(_OwnPending(pending), ()) == [pending[1]]  # type: ignore[arg-type]
