"""A read whose reply was lost (the connection dropped after Redis delivered the entries, or
Redis crashed with them in its persisted PEL): the entries are pending on the live worker's
own consumer, which never saw them. Its intake takes them again as soon as Redis answers,
long before the idle fallback (``claim_idle_ms``, 600 s here), and answers each once: for
an encoder and for a generating model (real Redis, the tiny models). Also when redis-py's
own retry hid the loss (a real dropped connection, Redis up: the retried read succeeds),
on one Redis and on a Redis Cluster."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import decode_result, encode_request
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Delta, Request
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runners.embedding import EmbeddingRunner
from batchfleet.worker.streams import ModelStreams
from gen_faults import CLAIM_IDLE_MS, make_loop, make_runner, submit
from hidden_cluster import HiddenCluster, running_hidden_cluster
from silent_network import SilentProxy

from batchfleet.config import ModelConfig, WorkerConfig
from batchfleet.connection import connect

pytestmark = pytest.mark.timeout(180)

ANSWERED_WITHIN_S = 10.0
"""Far below ``CLAIM_IDLE_MS``: without the intake's re-read the loop waits past it."""


class _LosingPipeline(redis.client.Pipeline):
    owner: LosingRedis

    def execute(self, raise_on_error: bool = True) -> Any:
        reads = any(args[0] == "XREADGROUP" for args, _ in self.command_stack)
        out = super().execute(raise_on_error)
        if reads and any(out):
            self.owner.lost_reply()
        return out


class LosingRedis(redis.Redis):
    """A client whose first ``XREADGROUP`` that Redis answers with entries loses the reply:
    Redis delivered them (they are pending on the reader), the caller gets a
    ``ConnectionError``, as when the connection drops while the answer is on its way."""

    to_lose = 1
    to_pass = 0
    """Replies with entries that reach the caller before the one lost."""

    def lost_reply(self) -> None:
        if self.to_pass:
            self.to_pass -= 1
        elif self.to_lose:
            self.to_lose -= 1
            raise redis.ConnectionError("connection lost while reading the reply (test)")

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = _LosingPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.owner = self
        return pipe

    def execute_command(self, *args: Any, **options: Any) -> Any:
        out = super().execute_command(*args, **options)
        if args[0] == "XREADGROUP" and out:
            self.lost_reply()
        return out


def run_until_answered(
    loop: BatchLoop, r: redis.Redis | redis.RedisCluster, key: str,
    within_s: float = ANSWERED_WITHIN_S,
) -> float:  # fmt: skip
    """Run ``loop`` until ``key`` (a result) exists; seconds it took. Fails past the bound."""
    thread = threading.Thread(target=loop.run, daemon=True)
    start = time.monotonic()
    thread.start()
    try:
        while r.get(key) is None:
            assert time.monotonic() - start < within_s, "not answered: left pending"
            time.sleep(0.05)
        return time.monotonic() - start
    finally:
        loop.stop()
        thread.join(30)


def test_an_encoders_entry_whose_read_reply_was_lost_is_answered_once(
    redis_url: str, r: redis.Redis, tiny_embedder: Path
) -> None:
    # Given a request, and a worker whose first read that finds it loses Redis's reply
    keys = ModelKeys("tiny")
    r.xadd(keys.lane(0), encode_request(Request(id="lost", model="tiny", inputs=["a dog"])))
    client = LosingRedis.from_url(redis_url)
    runner = EmbeddingRunner(tiny_embedder, device="cpu", max_tokens=32)
    loop = BatchLoop("tiny", ModelConfig(max_tokens=32), runner, client, consumer="w1",
                     worker=WorkerConfig(block_ms=50, claim_idle_ms=CLAIM_IDLE_MS))  # fmt: skip
    # When it runs
    run_until_answered(loop, r, keys.result("lost"))
    # Then the entry it never saw was taken again and answered, by it, and acked
    assert client.to_lose == 0  # (the reply was lost)
    res = decode_result(r.get(keys.result("lost")))
    assert res.ok and res.timings.worker == "w1"
    assert r.xpending(keys.lane(0), GROUP)["pending"] == 0


def test_a_generations_entry_whose_read_reply_was_lost_is_answered_once(
    redis_url: str, r: redis.Redis, tiny_lm: Path
) -> None:
    # Given a streamed generation, and a generating worker whose first read that finds it
    # loses Redis's reply
    job = submit(Producer(client=r), "the dog", 8, stream=True)
    client = LosingRedis.from_url(redis_url)
    loop = make_loop(client, make_runner(tiny_lm, ahead=False, break_at=0), "w1", burst=False)
    # When it runs
    run_until_answered(loop, r, job.result_key)
    # Then it was generated once: one result, its stream whole and numbered from 1
    assert client.to_lose == 0
    res = job.result(timeout=1)
    assert res.ok and res.usage is not None and res.usage.completion_tokens == 8
    deltas = list(job.deltas(timeout=1))
    assert all(isinstance(d, Delta) for d in deltas)  # no restart: one attempt streamed
    assert [d.seq for d in deltas if isinstance(d, Delta)] == list(range(1, len(deltas) + 1))


def test_after_a_lost_reply_what_the_loop_holds_is_not_taken_again(
    redis_url: str, r: redis.Redis, tiny_lm: Path
) -> None:
    # Given a worker generating a long request (read normally: the loop holds it), whose
    # read of a second request loses Redis's reply
    producer = Producer(client=r)
    first = submit(producer, "the dog", 600, stream=True)
    client = LosingRedis.from_url(redis_url)
    client.to_pass = 1
    loop = make_loop(client, make_runner(tiny_lm, ahead=False, break_at=0), "w1", burst=False)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        while not r.exists(ModelKeys(first.model).tokens(first.id)):  # it generates
            assert time.monotonic() - start < ANSWERED_WITHIN_S
            time.sleep(0.01)
        second = submit(producer, "the fox", 4, stream=True)
        # When both are answered
        res = [first.result(timeout=60), second.result(timeout=ANSWERED_WITHIN_S)]
    finally:
        loop.stop()
        thread.join(30)
    # Then the second's reply was lost and it was taken again, and the first (pending on
    # the same consumer, held by the loop) was not: one attempt, its stream never restarted
    assert client.to_lose == 0
    assert [x.ok for x in res] == [True, True]
    deltas = list(first.deltas(timeout=1))
    assert all(isinstance(d, Delta) for d in deltas)
    assert [d.seq for d in deltas if isinstance(d, Delta)] == list(range(1, len(deltas) + 1))


def test_taking_back_an_unseen_delivery_keeps_its_delivery_count(r: redis.Redis) -> None:
    # Given an entry delivered to w1 (whose reply w1 never saw)
    streams = ModelStreams(r, "tiny", 3, "w1")
    streams.ensure_groups()
    r.xadd(ModelKeys("tiny").lane(1), encode_request(Request(id="x", model="tiny", inputs=["a"])))
    streams.read({1: 10}, None)
    # When w1 takes its own pending entry again, uncounted
    (pending,) = streams.own_pending()
    (entry,) = streams.claim_own([pending], counted=False)
    # Then the entry is delivered once, as far as the poison rule is concerned
    assert entry.deliveries == 1 and entry.lane == 1
    (after,) = streams.own_pending()
    assert after.deliveries == 1 and after.id == pending.id


HIDDEN_WITHIN_S = 5.0
"""A loss redis-py's retry hid is found at the intake's next pass (the retried read blocks
``block_ms``, 50 ms): far below ``CLAIM_IDLE_MS``, where it would wait without the count."""


@pytest.fixture
def proxy(redis_url: str) -> Iterator[SilentProxy]:
    """A network in front of the session's Redis that can drop a connection with a reply."""
    started = SilentProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    yield started
    started.close()


def assert_hidden(proxy: SilentProxy, caplog: pytest.LogCaptureFixture) -> None:
    """The reply was lost, and redis-py's retry hid it: the intake saw no failure."""
    assert proxy.lost == 1
    assert "redis unreachable" not in caplog.text


def answered_by_an_encoder(
    client: Any, r: Any, tiny_embedder: Path, rid: str, proxy: SilentProxy,
    caplog: pytest.LogCaptureFixture, **worker: Any,
) -> None:  # fmt: skip
    """An encoder worker ``w1`` on ``client`` answers request ``rid`` (lane 0) once, within
    ``HIDDEN_WITHIN_S``, though the reply that handed it over was lost, the loss hidden."""
    keys = ModelKeys("tiny")
    runner = EmbeddingRunner(tiny_embedder, device="cpu", max_tokens=32)
    config = WorkerConfig(block_ms=50, claim_idle_ms=CLAIM_IDLE_MS, **worker)
    loop = BatchLoop("tiny", ModelConfig(max_tokens=32), runner, client, consumer="w1",
                     worker=config)  # fmt: skip
    run_until_answered(loop, r, keys.result(rid), HIDDEN_WITHIN_S)
    assert_hidden(proxy, caplog)
    res = decode_result(r.get(keys.result(rid)))
    assert res.ok and res.timings.worker == "w1"
    assert r.xpending(keys.lane(0), GROUP)["pending"] == 0
    client.close()


def test_an_encoders_entry_whose_lost_reply_redis_pys_retry_hid_is_answered_once(
    redis_url: str, r: redis.Redis, tiny_embedder: Path, proxy: SilentProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    # Given a request, and a worker with the fleet's client (its retries as configured by
    # default) behind a network that drops the connection carrying the read that finds it
    keys = ModelKeys("tiny")
    r.xadd(keys.lane(0), encode_request(Request(id="hidden", model="tiny", inputs=["a dog"])))
    proxy.lose_reply(b"XREADGROUP", b"hidden")
    # When it runs, then the loss was hidden from the worker's code, and the entry was
    # taken again and answered by it, once
    answered_by_an_encoder(connect(proxy.url()), r, tiny_embedder, "hidden", proxy, caplog)


def test_a_generations_entry_whose_lost_reply_redis_pys_retry_hid_is_answered_once(
    redis_url: str, r: redis.Redis, tiny_lm: Path, proxy: SilentProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    # Given a streamed generation, and a generating worker with the fleet's client behind
    # a network that drops the connection carrying the read that finds it
    job = submit(Producer(client=r), "the dog", 8, stream=True)
    proxy.lose_reply(b"XREADGROUP", job.id.encode())
    client = connect(proxy.url())
    loop = make_loop(client, make_runner(tiny_lm, ahead=False, break_at=0), "w1", burst=False)
    # When it runs
    run_until_answered(loop, r, job.result_key, HIDDEN_WITHIN_S)
    # Then it was generated once: one result, its stream whole and numbered from 1
    assert_hidden(proxy, caplog)
    res = job.result(timeout=1)
    assert res.ok and res.usage is not None and res.usage.completion_tokens == 8
    deltas = list(job.deltas(timeout=1))
    assert all(isinstance(d, Delta) for d in deltas)
    assert [d.seq for d in deltas if isinstance(d, Delta)] == list(range(1, len(deltas) + 1))
    client.close()


@pytest.fixture(scope="module")
def hidden_cluster() -> Iterator[HiddenCluster]:
    with running_hidden_cluster() as started:
        yield started


def test_on_a_cluster_an_entry_whose_lost_reply_the_retry_hid_is_answered_once(
    hidden_cluster: HiddenCluster, tiny_embedder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with hidden_cluster.fresh() as hidden, hidden.direct() as direct:
        # Given a request, and a worker with the fleet's cluster client, the connection to
        # the model's master dropped with the reply of the read that finds it
        keys = ModelKeys("tiny")
        req = Request(id="hidden", model="tiny", inputs=["a dog"])
        direct.xadd(keys.lane(0), encode_request(req))
        proxy = hidden.proxies[hidden.master_of(keys.lane(0))]
        proxy.lose_reply(b"XREADGROUP", b"hidden")
        # When it runs, then the cluster client's retry hid the loss, and the worker
        # answered it once
        client = connect(hidden.url)
        answered_by_an_encoder(client, direct, tiny_embedder, "hidden", proxy, caplog)


def test_an_entry_whose_takeover_reply_the_retry_hid_is_answered_once(
    r: redis.Redis, tiny_embedder: Path, proxy: SilentProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an entry held by a worker that died (its heartbeat long gone), and a live
    # worker behind a network that drops the connection carrying its XCLAIM of it
    keys = ModelKeys("tiny")
    dead = ModelStreams(r, "tiny", 3, "dead")
    dead.ensure_groups()
    r.xadd(keys.lane(0), encode_request(Request(id="orphan", model="tiny", inputs=["a dog"])))
    assert dead.read({0: 1}, None)
    time.sleep(0.3)  # (idle past the heartbeat timeout below)
    proxy.lose_reply(b"XCLAIM", b"orphan")
    # When it runs (its retried XCLAIM finds the entry no longer idle: it is w1's now),
    # then w1 took it again as a delivery it never saw, and answered it once
    client = connect(proxy.url())
    answered_by_an_encoder(client, r, tiny_embedder, "orphan", proxy, caplog,
                           heartbeat_timeout_ms=200)  # fmt: skip


def test_a_claim_of_a_previous_lifes_entry_sent_again_counts_one_delivery(
    r: redis.Redis, proxy: SilentProxy
) -> None:
    # Given an entry pending on w1 from its previous life (delivered once)
    ModelStreams(r, "tiny", 3, "w1").ensure_groups()
    keys = ModelKeys("tiny")
    r.xadd(keys.lane(2), encode_request(Request(id="again", model="tiny", inputs=["a"])))
    ModelStreams(r, "tiny", 3, "w1").read({2: 1}, None)
    client = connect(proxy.url())
    streams = ModelStreams(client, "tiny", 3, "w1")
    (pending,) = streams.own_pending()
    # When the new life claims it and the reply is lost (redis-py sends the XCLAIM again)
    proxy.lose_reply(b"XCLAIM", b"again")
    (entry,) = streams.claim_own([pending])
    # Then one delivery was counted, not one per XCLAIM sent
    assert proxy.lost == 1
    (after,) = streams.own_pending()
    assert entry.deliveries == after.deliveries == 2 and entry.lane == 2
    client.close()
