"""The data plane on a real 3-master Redis Cluster; Celery's broker on a plain redis-server:
requests, reclaims, and the fleet's reads (``status``, the control commands' and the
gateway's wait for the live workers) whose Redis ``TIME`` a cluster pipeline refuses."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from batchfleet.producer import AsyncProducer, Producer
from batchfleet.producer.gateway.dev_routes import DevAdmin
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.gateway.fleet_control import live_serving, live_workers
from batchfleet.schemas.keys import GROUP, ModelKeys
from cluster_helpers import LocalRedisCluster
from conftest import WorkerProcess, fleet_toml
from gateway_fakes import gateway_cli, gateway_in_process, http

from batchfleet import cli
from batchfleet.config import load_config
from batchfleet.connection import connect, connect_async, is_cluster_url
from batchfleet.groups import init_groups
from batchfleet.redis_server import LocalRedis

pytestmark = pytest.mark.timeout(180)

MODELS = ("tiny", "sentiment")  # their hash slots live on different masters (asserted below)
GHOSTED = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    c = LocalRedisCluster()
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def rc(cluster: LocalRedisCluster) -> Iterator[redis.RedisCluster]:
    client = connect(cluster.url)
    assert isinstance(client, redis.RedisCluster)
    yield client
    client.close()


@pytest.fixture(scope="module")
def cluster_fleet(
    cluster: LocalRedisCluster,
    redis_server: LocalRedis,
    tiny_embedder: Path,
    tiny_classifier: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    text = fleet_toml(
        cluster.url,
        {
            "tiny": {"runner": "embedding", "path": str(tiny_embedder), "max_tokens": 64,
                     "batch": {"max_batch_size": 32, "max_wait_ms": 5}},
            "sentiment": {"runner": "text-classification", "path": str(tiny_classifier),
                          "max_tokens": 64, "lanes": 2},
        },
    )  # fmt: skip
    first, _, rest = text.partition("\n")
    path = tmp_path_factory.mktemp("cluster") / "fleet.toml"
    path.write_text(f'{first}\nbroker_url = "{redis_server.url}"\n{rest}')
    return path


@pytest.fixture(scope="module")
def ghost_jobs(cluster_fleet: Path, rc: redis.RedisCluster) -> list[str]:
    """Requests a consumer read and then died with (before any worker runs)."""
    rc.flushall()
    init_groups(load_config(cluster_fleet))
    with Producer(str(load_config(cluster_fleet).redis_url)) as producer:
        jobs = producer.submit_many("tiny", [f"orphan {i}" for i in range(GHOSTED)], priority=0)
    stream = ModelKeys("tiny").lane(0)
    read = rc.xreadgroup(GROUP, "ghost", {stream: ">"}, count=100)
    assert len(read[0][1]) == GHOSTED
    time.sleep(2.1)  # past the fleet's claim_idle_ms (2000)
    return [j.id for j in jobs]


@pytest.fixture(scope="module")
def worker(
    cluster_fleet: Path,
    ghost_jobs: list[str],
    rc: redis.RedisCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("cluster-worker") / "w.log"
    w = WorkerProcess(cluster_fleet, "cw0", log)
    try:
        for model in MODELS:
            w.wait_ready(rc, model)
        yield w
    finally:
        assert w.stop() == 0


def test_cluster_url_and_models_on_different_shards(cluster: LocalRedisCluster) -> None:
    assert is_cluster_url(cluster.url)
    owners = {}
    for model in MODELS:
        keys = ModelKeys(model)
        names = [*keys.lanes(3), keys.result("x"), keys.dead, keys.workers, keys.lanes_key]
        assert len({cluster.owner(k) for k in names}) == 1, f"{model}: keys on several shards"
        owners[model] = cluster.owner(keys.lane(0))
    assert owners["tiny"] != owners["sentiment"]


def test_broker_url_is_required_with_a_cluster(cluster: LocalRedisCluster) -> None:
    plain = "redis://127.0.0.1:6379/3"
    assert load_config(None, redis_url=plain).celery_broker_url() == plain, "default: redis_url"
    assert load_config(None, redis_url=cluster.url, broker_url=plain).celery_broker_url() == plain
    with pytest.raises(ValueError, match="broker_url"):
        load_config(None, redis_url=cluster.url).celery_broker_url()
    with pytest.raises(ValueError, match="cannot be a Redis Cluster"):
        load_config(None, redis_url=cluster.url, broker_url=cluster.url)


def test_reclaims_a_dead_consumers_entries(
    worker: WorkerProcess, ghost_jobs: list[str], cluster: LocalRedisCluster
) -> None:
    with Producer(cluster.url) as producer:
        from batchfleet.producer.client import Job

        results = [Job(rid, "tiny", producer).result(timeout=30) for rid in ghost_jobs]
    assert all(r.ok for r in results)
    assert {r.timings.worker for r in results} == {"cw0"}


def test_submit_batch_and_results_by_poll_and_reply(
    worker: WorkerProcess, cluster: LocalRedisCluster, rc: redis.RedisCluster
) -> None:
    with Producer(cluster.url) as producer:
        # When requests go to both models (two shards), on every lane
        jobs = []
        for lane in range(3):
            jobs += producer.submit_many("tiny", [f"the dog {lane}-{i}" for i in range(40)],
                                         priority=lane)  # fmt: skip
        label = producer.submit("sentiment", "what a day", priority=0)
        # Then results come on the reply channel, and by polling
        results = list(producer.results(jobs, timeout=60))
        (out,) = label.outputs(timeout=30)
        assert jobs[0].result(timeout=5).ok
    assert sorted(r.id for r in results) == sorted(j.id for j in jobs)
    assert all(r.ok and len(r.outputs[0]) == 32 for r in results)
    assert max(r.timings.batch_size for r in results) > 1, "answered in micro-batches"
    assert out["label"] in {"negative", "neutral", "positive"}
    for lane in range(3):
        assert rc.xpending(ModelKeys("tiny").lane(lane), GROUP)["pending"] == 0


def test_async_producer_on_cluster(worker: WorkerProcess, cluster: LocalRedisCluster) -> None:
    async def go() -> list[str]:
        async with AsyncProducer(cluster.url) as producer:
            jobs = await producer.submit_many("tiny", [f"async {i}" for i in range(20)])
            one = await producer.submit("sentiment", "fine", priority=1)
            assert (await one.result(timeout=30)).ok
            return [r.status async for r in producer.results(jobs, timeout=60)]

    assert asyncio.run(go()) == ["ok"] * 20


@pytest.fixture
def no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No fleet file or broker from the environment: a command has its arguments alone."""
    for name in ("BATCHFLEET_CONFIG", "BATCHFLEET_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_status_on_a_cluster_shows_the_live_worker_and_its_lanes(
    worker: WorkerProcess, cluster_fleet: Path, cluster: LocalRedisCluster,
    no_fleet_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # When `status --json` reads the fleet its fleet file names (the broker: a plain Redis)
    assert cli.main(["status", "--json", "--config", str(cluster_fleet)]) == 0
    status = json.loads(capsys.readouterr().out)
    # Then each model shows with its lanes (two shards), and the live worker with each,
    # its heartbeat fresh by the cluster's clock, its stats answered through the broker
    lanes = {m["model"]: [lane["lane"] for lane in m["lanes"]] for m in status["models"]}
    assert lanes == {"tiny": [0, 1, 2], "sentiment": [0, 1]}
    rows = {(w["consumer"], w["model"]): w for w in status["workers"]}
    assert set(rows) == {("cw0", "tiny"), ("cw0", "sentiment")}
    assert all(0 <= w["heartbeat_age_s"] < 10 for w in rows.values())
    assert all(w["worker"].startswith("cw0@") and w["state"] != "stale" for w in rows.values())

    # When the tables are asked of the cluster's URL alone (no broker to ask the workers)
    no_fleet_env.setenv("COLUMNS", "200")
    assert cli.main(["status", "--redis-url", cluster.url]) == 0
    out, err = capsys.readouterr()
    # Then the lanes and the worker show from Redis, and stderr says why no stats
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()]
    assert [c[:4] for c in cells if c and c[0] in ("tiny", "sentiment")] == [
        ["sentiment", "text-classification", "64", "0"], ["tiny", "embedding", "64", "0"]]  # fmt: skip
    assert sorted(c[:3] for c in cells if c and c[0] == "cw0") == [
        ["cw0", "sentiment", "?"], ["cw0", "tiny", "?"]]  # fmt: skip
    assert "broker_url" in err and "heartbeats alone" in err


def test_a_control_command_waits_for_the_live_worker_on_a_cluster(
    worker: WorkerProcess, cluster_fleet: Path, cluster: LocalRedisCluster,
    redis_server: LocalRedis, no_fleet_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # When tiny's batch policy is set (to the fleet file's own: the other tests see no change)
    argv = ["policy", "tiny", "max_wait_ms=5", "--timeout", "30"]
    code = cli.main([*argv, "--config", str(cluster_fleet)])
    out, err = capsys.readouterr()
    # Then its live worker, read on the cluster, was waited for and did it
    assert code == 0, err
    (line,) = out.splitlines()
    host, _, reply = line.partition(": ")
    assert host.startswith("cw0@") and json.loads(reply)["changes"] == {"max_wait_ms": 5}
    # and given the cluster's URL alone, the command says where the broker must come from
    assert cli.main([*argv, "--redis-url", cluster.url]) == 2
    assert "set broker_url (or BATCHFLEET_BROKER_URL)" in capsys.readouterr().err
    no_fleet_env.setenv("BATCHFLEET_BROKER_URL", redis_server.url)
    assert cli.main([*argv, "--redis-url", cluster.url, "-d", "cw0"]) == 0
    assert capsys.readouterr().out.startswith("cw0@")


def test_the_gateway_s_fleet_control_on_a_cluster(
    worker: WorkerProcess, cluster: LocalRedisCluster, redis_server: LocalRedis,
    no_fleet_env: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    async def go() -> None:
        client = connect_async(cluster.url)
        try:
            # the live workers of models on two shards, by the cluster's clock
            assert await live_workers(client, ["tiny", "sentiment"]) == ["cw0"]
            assert list(await live_serving(client, "sentiment")) == ["cw0"]
        finally:
            await client.aclose()
        async with gateway_in_process(cluster.url, dev_admin=DevAdmin(redis_server.url)) as port:
            # a broadcast that waits for the model's live worker (no prefix cache: a no-op)
            for query in ("?model=tiny", ""):
                status, raw = await http(port, "POST", "/reset_prefix_cache" + query)
                assert (status, raw) == (200, b""), raw
        # a cluster given as the broker: refused as such (kombu would try localhost:6379)
        with pytest.raises(ApiError, match="broker cannot be a Redis Cluster") as refused:
            await DevAdmin(cluster.url).broadcast("bf_reset_prefix_cache", {}, ["cw0"])
        assert (refused.value.status, refused.value.code) == (503, "unavailable")

    asyncio.run(go())
    # `batchfleet gateway` on the cluster's URL alone: its control routes need a broker
    gateway = gateway_cli(no_fleet_env)
    argv = ["gateway", "--redis-url", cluster.url, "--server-dev-mode"]
    assert cli.main(argv) == 2
    assert gateway(*argv[1:], "--broker-url", redis_server.url)["dev_admin"] == DevAdmin(
        redis_server.url
    )
