"""Shared fixtures: a real server per session (redis-server, else the bundled Valkey: see
``batchfleet.redis_server.find_server``), tiny models, worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).parent))

from batchfleet.schemas.keys import ModelKeys
from hidden_cluster import HiddenCluster, running_hidden_cluster
from tiny_models import make_causal_lm, make_classifier, make_embedding_model
from tiny_vision import (
    make_clip,
    make_cross_encoder,
    make_siglip,
    make_siglip2_classifier,
    make_vit,
)

from batchfleet.redis_server import LocalRedis
from batchfleet.tied_process import tied_popen

SERVER_FACING = {
    "test_cluster.py",
    "test_cluster_cancel.py",
    "test_cluster_failover.py",
    "test_cluster_failover_gen.py",
    "test_dlq.py",
    "test_fleetview.py",
    "test_fuzz.py",
    "test_loop.py",
    "test_producer.py",
    "test_protocol_blind_gen.py",
    "test_protocol_raw.py",
    "test_security.py",
    "test_tied_process.py",
}
"""Test files exercising what differs between Redis-compatible servers (streams, Lua, ACL,
cluster): marked ``server``, which CI runs again against Valkey."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERVER_FACING:
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    server = LocalRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    """A flushed database on the session's redis-server."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("tiny-embedder"))


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_classifier(tmp_path_factory.mktemp("tiny-classifier"))


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a chat template, for the ``text-generation`` runner."""
    return make_causal_lm(tmp_path_factory.mktemp("tiny-lm"))


TINY_LM_OPTIONS = {"kv_cache_tokens": 2048, "page_size": 16, "step_tokens": 64, "max_running": 16}
"""Small cache and step budgets: the tiny model's whole cache in a few MB."""


def _tiny(make: Callable[[Path], Path], name: str) -> Any:
    """A session fixture: the tiny model ``make`` writes, in a temporary directory."""

    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make(tmp_path_factory.mktemp(name))

    return fixture


tiny_vit = _tiny(make_vit, "tiny-vit")
tiny_siglip2 = _tiny(make_siglip2_classifier, "tiny-siglip2")
tiny_clip = _tiny(make_clip, "tiny-clip")
tiny_siglip = _tiny(make_siglip, "tiny-siglip")
tiny_reranker = _tiny(make_cross_encoder, "tiny-reranker")


def next_message(pubsub: redis.client.PubSub, timeout: float = 5.0) -> Any:
    """The next message on a subscription (None if none within ``timeout``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (msg := pubsub.get_message(timeout=0.2)) is not None:
            return msg
    return None


def fleet_toml(
    redis_url: str, models: dict[str, dict[str, object]], worker: dict[str, object] | None = None
) -> str:
    """A fleet file's text from plain dicts (enough TOML for the tests)."""

    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    worker = {"claim_idle_ms": 2000, **(worker or {})}
    lines = [f'redis_url = "{redis_url}"', "[worker]"]
    lines += [f"{k} = {value(v)}" for k, v in worker.items()] + [""]
    for name, spec in models.items():
        tables = {k: v for k, v in spec.items() if isinstance(v, dict)}
        lines.append(f"[models.{name}]")
        lines += [f"{k} = {value(v)}" for k, v in spec.items() if not isinstance(v, dict)]
        for table, items in tables.items():
            lines.append(f"[models.{name}.{table}]")
            lines += [f"{k} = {value(v)}" for k, v in items.items()]
        lines.append("")
    return "\n".join(lines)


class WorkerProcess:
    """A real `batchfleet worker` (Celery worker) process."""

    def __init__(self, config: Path, name: str, log: Path, *extra: str, named: bool = True) -> None:
        self.name = name
        """Its consumer name in the groups (given as ``--name`` where ``named``; else the
        fleet file's ``[worker] name``)."""
        self.log = log
        here = str(Path(__file__).parent)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=path)
        with log.open("wb") as out:  # (dies with the test run, even one SIGKILLed)
            self.process = tied_popen(
                [sys.executable, "-m", "batchfleet", "worker", "--config", str(config),
                 *(["--name", name] if named else []), "--loglevel", "INFO", *extra],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip

    def wait_ready(self, client: redis.Redis, model: str, timeout: float = 120.0) -> None:
        """Ready once its batch loop for ``model`` has registered (it is reading); a worker
        loading several models on a loaded 2-core machine has taken over 60 s."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log.read_text()[-3000:]}")
            if client.hexists(ModelKeys(model).workers, self.name):
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.name} not ready:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no acks, like a crash or an OOM-killer."""
        self.process.kill()
        self.process.wait()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(config_text: str, name: str, *extra: str, named: bool = True) -> WorkerProcess:
        config = tmp_path / f"{name}.toml"
        config.write_text(config_text)
        w = WorkerProcess(config, name, tmp_path / f"{name}.log", *extra, named=named)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def hidden_cluster() -> Iterator[HiddenCluster]:
    """A 3-master cluster behind proxies that can go silent (:mod:`hidden_cluster`), one
    per test module."""
    with running_hidden_cluster() as started:
        yield started


@pytest.fixture
def hidden(hidden_cluster: HiddenCluster) -> Iterator[HiddenCluster]:
    """The cluster, flushed, every proxy passing; healed again after the test."""
    with hidden_cluster.fresh():
        yield hidden_cluster
