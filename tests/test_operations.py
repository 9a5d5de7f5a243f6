"""Operating the fleet with real processes: Flower, /metrics, celery control, status."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.worker.app import create_app
from conftest import WorkerProcess, fleet_toml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from batchfleet import cli, cli_observe
from batchfleet.config import load_config
from batchfleet.redis_server import free_port
from batchfleet.remote import parse_settings
from batchfleet.status import print_status
from batchfleet.tied_process import tied_popen

pytestmark = pytest.mark.timeout(120)
HOST = socket.gethostname()
KEYS = ModelKeys("tiny")


def ops_fleet(redis_url: str, tiny_embedder: Path, metrics_port: int, **batch: Any) -> str:
    text = fleet_toml(
        redis_url,
        {
            "tiny": {
                "runner": "embedding",
                "path": str(tiny_embedder),
                "max_tokens": 64,
                "batch": {"max_batch_size": 8, "max_wait_ms": 5, **batch},
            }
        },
    )
    return text + (
        f'\n[metrics]\nport = {metrics_port}\naddress = "127.0.0.1"\n'
        "[events]\nmax_batches_per_s = 100000\n"
    )


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a worker's /metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[Any, float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= set(lbl))


def wait_for(check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    end = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:
            value = None
            if time.monotonic() > end:
                raise
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what or check}")
        time.sleep(0.1)


@pytest.fixture
def flower(redis_url: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, REDIS_URL=redis_url, FLOWER_UNAUTHENTICATED_API="true")
    # `batchfleet flower` runs `celery -A batchfleet.remote flower`: a torch-free app
    with (tmp_path / "flower.log").open("wb") as log:
        proc = tied_popen(
            [sys.executable, "-m", "batchfleet", "flower", "--port", str(port),
             "--address", "127.0.0.1"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get_json(f"{url}/api/workers") is not None, 30, "flower to listen")
        maps = Path(f"/proc/{proc.pid}/maps")
        if maps.exists():
            assert "libtorch" not in maps.read_text(), "Flower loaded torch"
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_batchfleet_flower_leaves_the_workers_event_switch_to_the_operator() -> None:
    # Flower's default re-enables task events every 5 s, undoing `disable_events`
    assert cli_observe.flower_options([]) == ["--enable_events=False"]
    auth = ["--basic_auth=a:b"]
    assert cli_observe.flower_options(auth) == ["--enable_events=False", *auth]
    for asked in (["--enable_events=True"], ["--enable-events"], ["--enable_events", "true"]):
        assert cli_observe.flower_options(asked) == asked


def test_flower_shows_the_worker_and_each_micro_batch_as_a_task(
    flower: str,
    redis_url: str,
    r: redis.Redis,
    tiny_embedder: Path,
    start_worker: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    # Given Flower and a worker (batches of at most 8 rows)
    w = start_worker(ops_fleet(redis_url, tiny_embedder, free_port()), "flw")
    w.wait_ready(r, "tiny")

    # When 30 requests of one input and 5 of two inputs are answered
    with Producer(redis_url) as producer:
        jobs = producer.submit_many("tiny", [f"the dog {i}" for i in range(30)])
        jobs += [producer.submit("tiny", ["a cat", "a dog"], priority=0) for _ in range(5)]
        assert all(res.ok for res in producer.results(jobs, timeout=30))
    sizes = {res.timings.batch_id: res.timings.batch_size for res in (j.result() for j in jobs)}

    # Then Flower lists the worker, with batchfleet's stats on its page
    hostname = f"flw@{HOST}"
    workers = wait_for(
        lambda: (ws := get_json(f"{flower}/api/workers?refresh=1")) and hostname in ws and ws,
        what="the worker in /api/workers",
    )
    stats = workers[hostname]["stats"]["batchfleet"]["tiny"]
    assert stats["requests"]["ok"] == 35 and stats["rows"] == 40
    assert stats["state"] == "running" and stats["depth"] == {"0": 0, "1": 0, "2": 0}
    line = workers[hostname]["stats"]["batchfleet tiny"]  # Flower's "Other" tab: one line
    assert line.startswith("running |") and "answered: ok 35" in line and "lane depth 0/0/0" in line

    # and every micro-batch as a succeeded task named after the model, sized right
    def batch_tasks() -> dict[str, Any]:
        tasks = get_json(f"{flower}/api/tasks?taskname=batchfleet.batch.tiny&limit=1000")
        return tasks if len(tasks) == len(sizes) else {}

    tasks = wait_for(batch_tasks, what=f"{len(sizes)} batch tasks in /api/tasks")
    assert set(tasks) == set(sizes)
    for uuid, task in tasks.items():
        assert task["name"] == "batchfleet.batch.tiny"
        assert task["state"] == "SUCCESS" and task["runtime"] > 0
        assert task["worker"] == hostname
        assert f"'batch of {sizes[uuid]} rows'" in task["args"]
        assert 1 <= sizes[uuid] <= 8
    assert sum(sizes.values()) == 40

    # `celery control disable_events` stops the batch tasks; enable_events brings them back
    def batches_of(more: list[Any]) -> set[str]:
        assert all(res.ok for res in producer.results(more, timeout=30))
        return {j.result().timings.batch_id for j in more}

    control = create_app(load_config(overrides_path(tmp_path, redis_url))).control
    assert "disabled" in str(control.disable_events(destination=[hostname], reply=True))
    with Producer(redis_url) as producer:
        silent = batches_of(producer.submit_many("tiny", ["the cat"] * 5))
        assert "enabled" in str(control.enable_events(destination=[hostname], reply=True))
        loud = batches_of(producer.submit_many("tiny", ["the cow"] * 5))
    wait_for(lambda: loud <= set(get_json(f"{flower}/api/tasks?limit=1000")), what="new tasks")
    assert not silent & set(get_json(f"{flower}/api/tasks?limit=1000"))


def test_control_metrics_and_status_change_and_show_what_the_worker_does(
    redis_url: str,
    r: redis.Redis,
    tiny_embedder: Path,
    start_worker: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    port = free_port()
    w = start_worker(ops_fleet(redis_url, tiny_embedder, port), "ctl")
    w.wait_ready(r, "tiny")
    producer = Producer(redis_url)
    env = dict(os.environ, REDIS_URL=redis_url)
    dest = ["-d", f"ctl@{HOST}"]  # answers as soon as that worker replies

    # Pause through plain `celery control`: new requests stay queued
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "batchfleet.worker.app", "control",
         "bf_pause", "tiny"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0 and f"ctl@{HOST}: OK" in out.stdout and "pause" in out.stdout, out
    jobs = producer.submit_many("tiny", [f"the dog {i}" for i in range(12)], priority=1)
    jobs += producer.submit_many("tiny", [f"a cat {i}" for i in range(3)], priority=2)
    time.sleep(1.0)
    assert all(r.get(KEYS.result(j.id)) is None for j in jobs)
    assert r.xlen(KEYS.lane(1)) == 12 and r.xpending(KEYS.lane(1), GROUP)["pending"] == 0

    # /metrics shows the backlog, read from Redis at scrape time
    m = scrape(port)
    assert total(m, "batchfleet_stream_length", lane="1") == 12
    assert total(m, "batchfleet_stream_lag", lane="1") == 12
    assert total(m, "batchfleet_stream_length", lane="2") == 3
    assert total(m, "batchfleet_stream_pending") == 0
    assert total(m, "batchfleet_oldest_waiting_seconds", lane="1") >= 0.9
    assert total(m, "batchfleet_model_workers", model="tiny") == 1
    assert total(m, "batchfleet_results_total") == 0

    # `batchfleet status` prints the same depths and the paused worker
    console = Console(record=True, width=200)
    status = print_status(redis_url, console=console)
    text = console.export_text()
    (model,) = status.models
    assert [(row.lane, row.length, row.lag) for row in model.lanes] == [
        (0, 0, 0),
        (1, 12, 12),
        (2, 3, 3),
    ]
    assert f"ctl@{HOST}" in text and "paused" in text
    (row,) = status.to_json()["workers"]
    assert (row["worker"], row["consumer"], row["state"]) == (f"ctl@{HOST}", "ctl", "paused")
    cells = [line.replace("│", " ").split() for line in text.splitlines()]
    assert ["1", "12", "0", "12"] in [c[:4] for c in cells], "lane 1: depth, pending, lag"

    # Resume (the batchfleet wrapper, to the worker by the bare name status shows): they
    # are answered, in batches of up to 8
    assert cli.main(["resume", "tiny", "--redis-url", redis_url, "-d", "ctl"]) == 0
    results = list(producer.results(jobs, timeout=30))
    assert all(res.ok for res in results)
    assert max(res.timings.batch_size for res in results) > 2

    # and the counters match what was processed (counted once each result is stored,
    # which a client may see first)
    def counted() -> dict[Any, float] | None:
        m = scrape(port)
        return m if total(m, "batchfleet_results_total", model="tiny", status="ok") == 15 else None

    m = wait_for(counted, what="15 ok results counted")
    assert total(m, "batchfleet_results_total", lane="2") == 3
    assert total(m, "batchfleet_batch_rows_processed_total") == 15
    batches = len({res.timings.batch_id for res in results})
    assert total(m, "batchfleet_batch_rows_count") == batches
    assert total(m, "batchfleet_batches_total") == batches
    assert total(m, "batchfleet_request_latency_seconds_count") == 15
    assert total(m, "batchfleet_stream_length") == 0

    # A live policy change alters batch sizes: the same backlog now leaves 2 rows at a time
    assert cli.main(["pause", "--redis-url", redis_url, *dest]) == 0
    assert cli.main(["policy", "tiny", "max_batch_size=2", "max_wait_ms=1",
                     "--redis-url", redis_url, *dest]) == 0  # fmt: skip
    jobs = producer.submit_many("tiny", [f"the dog {i}" for i in range(12)], priority=1)
    time.sleep(0.3)
    assert cli.main(["resume", "--redis-url", redis_url, *dest]) == 0
    results = list(producer.results(jobs, timeout=30))
    assert all(res.ok for res in results)
    assert max(res.timings.batch_size for res in results) == 2
    state = _inspect(redis_url, "bf_state")[f"ctl@{HOST}"]["tiny"]
    assert state["policy"]["max_batch_size"] == 2 and state["state"] == "running"

    # A bad setting is refused, and the policy stays
    assert cli.main(["policy", "tiny", "max_batch_size=0", "--redis-url", redis_url, *dest]) == 1
    assert _inspect(redis_url, "bf_state")[f"ctl@{HOST}"]["tiny"]["policy"]["max_batch_size"] == 2
    producer.close()


def test_drain_answers_what_it_holds_then_the_worker_exits_and_another_takes_over(
    redis_url: str,
    r: redis.Redis,
    tiny_embedder: Path,
    start_worker: Callable[..., WorkerProcess],
) -> None:
    # Given a worker busy with a backlog of 300 requests
    fleet = ops_fleet(redis_url, tiny_embedder, free_port())
    w = start_worker(fleet, "drn")
    w.wait_ready(r, "tiny")
    producer = Producer(redis_url)
    jobs = producer.submit_many("tiny", [f"the dog {i}" for i in range(300)], priority=2)
    wait_for(lambda: r.exists(KEYS.result(jobs[0].id)), what="the first result")

    # When it is drained
    assert cli.main(["drain", "--redis-url", redis_url, "-d", f"drn@{HOST}"]) == 0

    # Then it answers what it read, leaves the rest queued, and exits cleanly
    assert w.process.wait(30) == 0
    assert r.xpending(KEYS.lane(2), GROUP)["pending"] == 0, "nothing left half-done"
    answered = sum(r.exists(KEYS.result(j.id)) for j in jobs)
    assert 0 < answered < 300 and r.xlen(KEYS.lane(2)) == 300 - answered

    # and a new worker joining answers the rest: no request lost
    start_worker(fleet, "drn2").wait_ready(r, "tiny")
    assert all(res.ok for res in producer.results(jobs, timeout=60))
    producer.close()


def overrides_path(tmp_path: Path, redis_url: str) -> Path:
    path = tmp_path / "client.toml"
    path.write_text(f'redis_url = "{redis_url}"\n')
    return path


def _inspect(redis_url: str, command: str, dest: str = f"ctl@{HOST}") -> dict[str, Any]:
    from celery import Celery

    app = Celery("t", broker=redis_url, set_as_current=False)
    try:
        inspect = app.control.inspect(timeout=5, destination=[dest], limit=1)
        return dict(inspect._request(command) or {})
    finally:
        app.close()


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["max_batch_size=8"], {"max_batch_size": 8}),
        (["max_wait_ms=2.5", "adaptive=false"], {"max_wait_ms": 2.5, "adaptive": False}),
        (["lane_weights=4,2,1"], {"lane_weights": [4.0, 2.0, 1.0]}),
        (["lane_weights=[3, 1]"], {"lane_weights": [3, 1]}),
        (["preferred_batch_sizes=16"], {"preferred_batch_sizes": [16]}),
        (["max_batch_tokens=null"], {"max_batch_tokens": None}),
    ],
)
def test_policy_settings_parse(items: list[str], expected: dict[str, Any]) -> None:
    assert parse_settings(items) == expected


def test_policy_settings_need_key_and_value() -> None:
    with pytest.raises(ValueError, match="key=value"):
        parse_settings(["max_batch_size"])


def test_generation_budgets_change_live_within_the_fleet_files() -> None:
    from batchfleet.batching.gen_types import GenPolicy
    from batchfleet.worker.control import generation_budgets

    configured = GenPolicy(kv_cache_tokens=4096, page_size=16, step_tokens=512, max_running=64)
    lower = generation_budgets(configured, configured, {"max_running": 8, "step_tokens": 128,
                                                        "lane_weights": [8, 2, 1]})  # fmt: skip
    assert (lower.max_running, lower.step_tokens, lower.lane_weights) == (8, 128, (8.0, 2.0, 1.0))
    back = generation_budgets(lower, configured, {"max_running": 64, "max_starvation_ms": 500})
    assert (back.max_running, back.step_tokens, back.max_starvation_ms) == (64, 128, 500.0)
    for bad in ({"max_running": 65}, {"step_tokens": 0}, {"max_running": "8"},
                {"kv_cache_tokens": 1024}, {"max_batch_size": 8}, {"lane_weights": [1, 2]},
                {"lane_weights": [1, 0, 1]}, {"step_tokens": 32, "max_running": 64}):  # fmt: skip
        with pytest.raises(ValueError):
            generation_budgets(configured, configured, bad)
