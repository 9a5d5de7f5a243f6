"""The worker's health endpoint, on a real worker process: unready while loading and draining."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
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


def test_unready_while_loading_and_draining(
    redis_url: str,
    r: redis.Redis,
    tiny_embedder: Path,
    tmp_path: Path,
    start_worker: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker whose model load and batches wait for the test's go-ahead
    gate = tmp_path / "gate"
    gate.mkdir()
    port = free_port()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    text = fleet_toml(redis_url, {"tiny": {"runner": "gated_handler:GatedEmbedding",
                                           "path": str(tiny_embedder), "max_tokens": 32,
                                           "options": {"gate": str(gate)}}})  # fmt: skip
    text += f'\n[health]\nport = {port}\nhost = "127.0.0.1"\n'
    w = start_worker(text, "healthy")

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
