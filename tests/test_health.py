"""The worker's health endpoint, on a real worker process: unready while loading and draining."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.worker.health import Health
from conftest import WorkerProcess, fleet_toml

from batchfleet.redis_server import free_port

pytestmark = pytest.mark.timeout(120)


def probe(port: int, path: str) -> tuple[int, dict[str, object]]:
    """(status, body) of one GET; (0, {}) while nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except (ConnectionError, urllib.error.URLError):
        return 0, {}


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_health_phases_without_a_server() -> None:
    import threading

    health = Health()
    assert health.ready()[0] is False and health.live()[0] is True
    alive = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    alive.start()
    health.serving([alive])
    assert health.ready()[0] is True
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    health.serving([alive, dead])
    assert health.ready()[0] is False and health.live()[0] is False
    health.draining()
    assert health.ready() == (False, {"phase": "draining", "detail": health.ready()[1]["detail"]})
    assert health.live()[0] is True


def test_a_hung_device_fails_liveness_and_readiness_until_its_step_ends() -> None:
    hung: dict[str, float | None] = {"a": None, "b": None}
    health = Health()
    health.serving([], {m: (lambda m=m: hung[m]) for m in hung})
    assert health.live() == (True, {"phase": "serving", "dead_loops": [], "hung_devices": {},
                                    "broken_devices": {}})  # fmt: skip
    assert health.ready()[0] is True
    hung["b"] = 312.345
    ok, body = health.live()
    assert not ok and body["hung_devices"] == {"b": 312.3}
    assert health.ready() == (False, {"phase": "serving", "detail": "devices hung: {'b': 312.3}"})
    health.draining()  # a hung device blocks the drain too: still not live
    assert health.live()[0] is False
    hung["b"] = None
    assert health.live()[0] is True


def test_a_broken_runner_fails_liveness_and_readiness_until_a_step_of_it_runs() -> None:
    # (``BatchLoop.broken``: the steps its runner raised in a row, once they are two or more)
    broken: dict[str, int | None] = {"a": None, "b": None}
    health = Health()
    health.serving([], {}, {m: (lambda m=m: broken[m]) for m in broken})
    assert health.live() == (True, {"phase": "serving", "dead_loops": [], "hung_devices": {},
                                    "broken_devices": {}})  # fmt: skip
    broken["a"] = 2
    ok, body = health.live()
    assert not ok and body["broken_devices"] == {"a": 2}
    assert health.ready() == (
        False, {"phase": "serving", "detail": "devices broken (steps raised in a row): {'a': 2}"}
    )  # fmt: skip
    broken["a"] = None
    assert health.live()[0] is True and health.ready()[0] is True


@pytest.fixture
def gated_worker(
    redis_url: str,
    tiny_embedder: Path,
    tmp_path: Path,
    start_worker: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., tuple[Path, int, WorkerProcess]]:
    """Starts a worker serving ``tiny`` by :class:`GatedEmbedding` with its health on a free
    port and the given ``claim_idle_ms`` (and other ``[worker]`` settings): (its gate
    folder, the port, the worker)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH", "")]))  # fmt: skip

    def start(claim_idle_ms: int, **worker: object) -> tuple[Path, int, WorkerProcess]:
        port = free_port()
        text = fleet_toml(redis_url, {"tiny": {"runner": "gated_handler:GatedEmbedding",
                                               "path": str(tiny_embedder), "max_tokens": 32,
                                               "options": {"gate": str(gate)}}},
                          worker={"claim_idle_ms": claim_idle_ms, **worker})  # fmt: skip
        text += f'\n[health]\nport = {port}\nhost = "127.0.0.1"\n'
        return gate, port, start_worker(text, "gated")

    return start


def test_unready_while_loading_and_draining(
    redis_url: str, r: redis.Redis, gated_worker: Callable[..., tuple[Path, int, WorkerProcess]]
) -> None:
    # Given a worker whose model load and batches wait for the test's go-ahead
    gate, port, w = gated_worker(600_000)  # claim_idle_ms: its device never counts as hung

    # While the model loads: live, not ready
    wait_for(lambda: probe(port, "/readyz")[0] != 0, "health endpoint up")
    status, body = probe(port, "/readyz")
    assert (status, body["phase"]) == (503, "starting")
    assert "loading model tiny" in str(body["detail"])
    assert probe(port, "/livez")[0] == 200

    # Once loaded and its loop runs: ready
    (gate / "load").touch()
    wait_for(lambda: probe(port, "/readyz")[0] == 200, "ready after load")
    w.wait_ready(r, "tiny")

    # While draining (SIGTERM during a batch): unready, still live, until the batch is out
    with Producer(redis_url) as producer:
        job = producer.submit("tiny", "the dog", priority=0)
        wait_for(lambda: (gate / "running").exists(), "batch running")
        w.process.terminate()
        wait_for(lambda: probe(port, "/readyz")[0] == 503, "unready on SIGTERM", 15)
        assert probe(port, "/readyz")[1]["phase"] == "draining"
        assert probe(port, "/livez")[0] == 200
        assert w.process.poll() is None, "still finishing its batch"
        (gate / "run").touch()
        assert job.result(timeout=30).ok, "the running batch was published"
    assert w.process.wait(30) == 0
    assert probe(port, "/readyz")[0] == 0, "endpoint closed on exit"


def test_a_hung_device_fails_liveness_until_its_batch_ends(
    redis_url: str, r: redis.Redis, gated_worker: Callable[..., tuple[Path, int, WorkerProcess]]
) -> None:
    # Given a worker whose batch waits for the test's go-ahead, the idle fallback at 1 s
    gate, port, w = gated_worker(1000)
    (gate / "load").touch()
    w.wait_ready(r, "tiny")
    wait_for(lambda: probe(port, "/livez")[0] == 200, "live")

    with Producer(redis_url) as producer:
        job = producer.submit("tiny", "the dog", priority=0)
        wait_for(lambda: (gate / "running").exists(), "batch running")

        # When its batch runs past claim_idle_ms: not live (the orchestrator restarts it),
        # not ready, the model named
        wait_for(lambda: probe(port, "/livez")[0] == 503, "not live while the device hangs")
        status, body = probe(port, "/livez")
        assert status == 503 and list(body["hung_devices"]) == ["tiny"]  # type: ignore[call-overload]
        assert "devices hung" in str(probe(port, "/readyz")[1]["detail"])

        # Then once the batch ends: the request is answered, and the worker live again
        (gate / "run").touch()
        assert job.result(timeout=30).ok
        wait_for(lambda: probe(port, "/livez") == (200, {"ok": True, "phase": "serving",
                                                          "dead_loops": [], "hung_devices": {},
                                                          "broken_devices": {}}),
                 "live again")  # fmt: skip


@pytest.mark.parametrize("warm_first", [False, True], ids=["SIGQUIT", "SIGTERM-then-SIGQUIT"])
def test_a_cold_shutdown_hands_the_running_batch_back_at_once(
    redis_url: str,
    r: redis.Redis,
    gated_worker: Callable[..., tuple[Path, int, WorkerProcess]],
    warm_first: bool,
) -> None:
    # Given a worker whose batch never ends, with an hour's shutdown grace (a warm stop
    # would wait it out) and a long idle fallback (a request handed back is marked idle
    # this long; one merely left pending is not)
    claim_idle_ms = 600_000
    gate, port, w = gated_worker(claim_idle_ms, shutdown_grace_s=3600)
    (gate / "load").touch()
    w.wait_ready(r, "tiny")
    with Producer(redis_url) as producer:
        job = producer.submit("tiny", "the dog", priority=0)
        wait_for(lambda: (gate / "running").exists(), "batch running")
        # When it gets a cold shutdown (SIGQUIT), alone or during a warm one (SIGTERM)
        if warm_first:
            w.process.terminate()
            wait_for(lambda: probe(port, "/readyz")[1].get("phase") == "draining", "draining")
        w.process.send_signal(signal.SIGQUIT)
        # Then it exits without waiting for the batch, the request unanswered and handed
        # back to the fleet for the next worker's reclaim
        w.process.wait(30)
        keys = ModelKeys("tiny")
        assert r.get(keys.result(job.id)) is None
        (pending,) = r.xpending_range(keys.lane(0), GROUP, "-", "+", 10)
        assert pending["time_since_delivered"] >= claim_idle_ms
