"""Control commands reach, and hear back from, real workers however each is named: with
``--name``, with only the fleet file's ``[worker] name``, and under plain ``celery worker
-n`` (its consumer name then its Celery hostname). Real Redis, real Celery workers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from batchfleet.schemas.keys import ModelKeys
from conftest import WorkerProcess, fleet_toml

from batchfleet import cli
from batchfleet.tied_process import tied_popen

MODEL = "emb"


@pytest.fixture
def plain_celery(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """A worker started as ``celery -A batchfleet.worker.app worker -n NAME@%h``."""
    started: list[WorkerProcess] = []

    def start(config_text: str, node: str, name: str | None = None) -> WorkerProcess:
        """``name``: its fleet file's ``[worker] name`` (None: it has none)."""
        config = tmp_path / f"{node}.toml"
        config.write_text(config_text)
        w = WorkerProcess.__new__(WorkerProcess)
        w.name, w.log = name or f"{node}@{socket.gethostname()}", tmp_path / f"{node}.log"
        here = str(Path(__file__).parent)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=path,
                   BATCHFLEET_CONFIG=str(config))  # fmt: skip
        with w.log.open("wb") as out:
            w.process = tied_popen(
                [sys.executable, "-m", "celery", "-A", "batchfleet.worker.app", "worker",
                 "-P", "solo", "-n", f"{node}@%h", "-Q", "batchfleet", "--without-mingle",
                 "--without-gossip", "--loglevel", "INFO"],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def control(capsys: pytest.CaptureFixture[str], redis_url: str, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv, "--redis-url", redis_url, "--timeout", "30"])
    out, err = capsys.readouterr()
    return code, out, err


def test_workers_named_every_way_are_waited_for_and_reached_by_name(
    redis_url: str, r: redis.Redis, tiny_embedder: Path,
    start_worker: Callable[..., WorkerProcess],
    plain_celery: Callable[..., WorkerProcess],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # Given four workers of one model: "w1" by --name, "w2" by its fleet file alone, and two
    # under plain celery: one named by its hostname only, "w4" by its fleet file (its
    # hostname c4@...); their fleet files' heartbeat timeout is 9 s
    models = {MODEL: {"runner": "embedding", "path": str(tiny_embedder), "max_tokens": 32}}
    beat = {"heartbeat_timeout_ms": 9000}
    host = socket.gethostname()
    workers = [
        start_worker(fleet_toml(redis_url, models, beat), "w1"),
        start_worker(fleet_toml(redis_url, models, beat | {"name": "w2"}), "w2", named=False),
        plain_celery(fleet_toml(redis_url, models, beat), "c3"),
        plain_celery(fleet_toml(redis_url, models, beat | {"name": "w4"}), "c4", "w4"),
    ]
    for w in workers:
        w.wait_ready(r, MODEL)
    # Then they published their fleet file's heartbeat timeout, for control commands
    assert r.get(ModelKeys(MODEL).heartbeat_timeout) == b"9000"

    # When the model is paused
    code, out, err = control(capsys, redis_url, "pause", MODEL)
    # Then each replied, known by its name: nobody is missing
    assert (code, err) == (0, "")
    replied = sorted(line.split(": ", 1)[0] for line in out.splitlines())
    assert replied == [f"c3@{host}", f"c4@{host}", f"w1@{host}", f"w2@{host}"]

    # When the worker named in its fleet file alone is resumed by that name
    code, out, err = control(capsys, redis_url, "resume", MODEL, "-d", "w2")
    # Then it alone got it, and replied
    assert (code, err) == (0, "")
    assert [line.split(": ", 1)[0] for line in out.splitlines()] == [f"w2@{host}"]
    # and so are the plain celery workers, by their hostname or the name before its @,
    # and the one named in its fleet file by that name too
    for name, node in (("c3", "c3"), (f"c3@{host}", "c3"), ("w4", "c4"), ("c4", "c4")):
        code, out, err = control(capsys, redis_url, "resume", MODEL, "-d", name)
        assert (code, err, out.split(": ", 1)[0]) == (0, "", f"{node}@{host}"), name
