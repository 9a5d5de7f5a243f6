"""A Redis Cluster master ``kill -9``'d while a generating worker streams: its replica,
stopped for a moment before (so the deltas the master acknowledged meanwhile are lost with
it), is promoted, and the fleet follows. Every streamed request gets one result, and its
token stream, read by a reader that followed it through the failover or by one that
starts after, is at most one restart (the documented ``reset``) then the deltas of the
result; a request cancelled after the failover ends ``cancelled``; nothing stays pending.
The gateway answers a chat sent in the window late or a 503 ``unavailable`` with
``Retry-After`` (its model check is retried as the producer's calls are:
``tests/test_gateway_failover.py``), and serves again by itself. Real processes: a 6-node cluster, a
generating worker (its Celery broker a plain Redis), a gateway, a producer."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.client import Job
from batchfleet.producer.tokens import Restarted
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Delta
from conftest import WorkerProcess
from failover_cluster import FailoverCluster, fleet_file, running_failover_cluster
from test_gateway import KEY, start_gateway
from tiny_models import make_causal_lm

from batchfleet.connection import connect
from batchfleet.redis_server import LocalRedis

pytestmark = pytest.mark.timeout(480)

MODEL = "tinylm"
KEYS = ModelKeys(MODEL)
STREAMED = 6
TOKENS = 1500
"""Each streamed request's length (``ignore_eos``): still generating at the kill."""
CANCELLED_TOKENS = 3500
"""The request cancelled after the failover: far from done by then."""
LOST_AT_LEAST = 4
"""Deltas the master acknowledges while its replica is stopped (all lost with it)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[FailoverCluster]:
    with running_failover_cluster() as c:
        yield c


@dataclass
class Fleet:
    url: str
    worker: WorkerProcess
    gateway: str
    """The gateway's base URL."""


@pytest.fixture
def fleet(cluster: FailoverCluster, redis_server: LocalRedis, tmp_path: Path) -> Iterator[Fleet]:
    """A generating worker and a gateway on a node the failover leaves alone, both started
    before either is waited for (each loads torch and transformers: on a loaded 2-core
    machine, a minute or more)."""
    url = cluster.url_for(KEYS.lane(0))
    lm = make_causal_lm(tmp_path / "lm", context=4096)
    opts = {"kv_cache_tokens": 16384, "page_size": 16, "step_tokens": 64, "max_running": 16,
            "max_new_tokens": 4000}  # fmt: skip
    config = fleet_file(tmp_path / "fleet.toml", url, redis_server.url,
                        {MODEL: {"runner": "text-generation", "path": str(lm), "options": opts}})  # fmt: skip
    worker = WorkerProcess(config, "gw0", tmp_path / "gw0.log")
    client = connect(url)
    gateway: subprocess.Popen[bytes] | None = None
    try:
        gateway, base = start_gateway(url, tmp_path)
        worker.wait_ready(client, MODEL, timeout=300)
        yield Fleet(url, worker, base)
    finally:
        client.close()
        if gateway is not None:
            gateway.terminate()
            gateway.wait(10)
        assert worker.stop() == 0


def _chat(base: str, content: str, max_tokens: int) -> tuple[int, dict[str, str], bytes]:
    """A streamed chat through the gateway: its status, headers and whole body."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}  # fmt: skip
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _sse_text(body: bytes) -> str:
    """The content of a streamed chat's chunks (raises on an error event)."""
    text = ""
    for line in body.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk
        text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text


def _after_last_restart(events: list[Delta | Restarted]) -> tuple[int, list[Delta]]:
    """How many restarts a reader saw, and the deltas after the last."""
    restarts = [i for i, e in enumerate(events) if isinstance(e, Restarted)]
    start = restarts[-1] + 1 if restarts else 0
    return len(restarts), [e for e in events[start:] if isinstance(e, Delta)]


def _poll_len(get: Callable[[], Sized], at_least: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while len(get()) < at_least and time.monotonic() < end:
        time.sleep(0.01)


def test_a_master_killed_while_generating_loses_no_stream_and_answers_each_once(
    cluster: FailoverCluster, fleet: Fleet
) -> None:
    worker, gateway = fleet.worker, fleet.gateway
    producer = Producer(fleet.url)
    ids = [f"gen-{i}" for i in range(STREAMED)]

    def submit(rid: str, tokens: int) -> Job:
        return producer.submit(MODEL, messages=[{"role": "user", "content": f"tell {rid}"}],
                               max_new_tokens=tokens, ignore_eos=True, stream=True,
                               temperature=0, request_id=rid, priority=0)  # fmt: skip

    # Given streamed greedy generations under way, each followed by a reader
    jobs = {rid: submit(rid, TOKENS) for rid in ids}
    seen: dict[str, list[Delta | Restarted]] = {rid: [] for rid in ids}
    failed: list[BaseException] = []

    def follow(job: Job) -> None:
        try:
            seen[job.id].extend(job.deltas(timeout=180))
        except BaseException as exc:
            failed.append(exc)

    readers = [threading.Thread(target=follow, args=(job,)) for job in jobs.values()]
    for reader in readers:
        reader.start()
    master = cluster.owner(KEYS.lane(0))

    def written() -> list[int]:
        with redis.Redis(port=master) as node:
            return [node.xlen(KEYS.tokens(rid)) for rid in ids]

    _poll_len(lambda: [n for n in written() if n >= 10], STREAMED)
    lost: list[int] = []

    def cut() -> None:  # the master acknowledges deltas alone
        before = sum(written())
        _poll_len(lambda: range(sum(written()) - before), LOST_AT_LEAST, timeout=1.0)
        lost.append(sum(written()) - before)

    window: list[tuple[int, dict[str, str], bytes]] = []
    asked = threading.Thread(target=lambda: window.append(_chat(gateway, "in the window", 8)))

    # When the master of the model's slot dies with deltas its replica never received, a
    # client asks the gateway for a chat before the replica is promoted, and it is promoted
    failover = cluster.kill_master_of(KEYS.lane(0), cut_replica=cut, while_dead=asked.start)
    cluster.promoted(failover, KEYS.lane(0))
    assert lost and lost[0] >= LOST_AT_LEAST, "deltas written while the replica was cut off"

    # Then a request cancelled after the failover ends cancelled
    cancelled = submit("cancelled", CANCELLED_TOKENS)
    first = next(iter(cancelled.deltas(timeout=120)))
    assert isinstance(first, Delta)
    cancelled.cancel()
    result = cancelled.result(timeout=120)
    assert result.ok and result.outputs[0]["finish_reason"] == "cancelled"
    # and every streamed request has its result, once, and each reader (the one that
    # followed through the failover, and one starting now) sees at most one restart, then
    # the result's deltas, in order
    for reader in readers:
        reader.join(180)
    assert not failed, failed
    for rid, job in jobs.items():
        text = job.text(timeout=120)
        for events in (seen[rid], list(job.deltas(timeout=60))):
            restarts, deltas = _after_last_restart(events)
            assert restarts <= 1, (rid, restarts)
            assert [d.seq for d in deltas] == list(range(1, len(deltas) + 1)), rid
            assert "".join(d.text for d in deltas) == text, rid
    with redis.Redis(port=failover.heir) as heir:
        for rid in [*ids, "cancelled"]:
            ends = [f for _, f in heir.xrange(KEYS.tokens(rid)) if b"end" in f]
            assert len(ends) == 1, (rid, ends)
        _poll_len(lambda: [] if heir.xpending(KEYS.lane(0), GROUP)["pending"] else [1], 1)
        assert heir.xpending(KEYS.lane(0), GROUP)["pending"] == 0
        assert heir.xlen(KEYS.dead) == 0
    # and the gateway answered the chat asked in the window late, or a 503 to retry
    asked.join(120)
    ((status, headers, body),) = window
    if status == 503:
        assert int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["code"] == "unavailable"
    else:
        assert status == 200 and _sse_text(body)
    # and serves again by itself, without a restart
    status, _, body = _chat(gateway, "after the failover", 8)
    assert status == 200 and _sse_text(body)
    assert worker.alive()
    producer.close()
