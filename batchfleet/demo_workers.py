"""The worker processes `batchfleet demo` starts (and stops)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .connection import connect
from .schemas.keys import ModelKeys
from .tied_process import tied_popen


@dataclass(frozen=True, slots=True)
class DemoWorker:
    """A `batchfleet worker` process the demo started, serving ``model``."""

    proc: subprocess.Popen[bytes]
    name: str
    model: str
    log: Path

    def ready(self, url: str) -> bool:
        """True once it serves its model; raises if it exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{self.log.read_text()[-2000:]}")
        client = connect(url)
        try:
            return bool(client.hexists(ModelKeys(self.model).workers, self.name))
        finally:
            client.close()

    def wait_ready(self, url: str, timeout: float = 180.0) -> None:
        end = time.monotonic() + timeout
        while not self.ready(url):
            if time.monotonic() > end:
                raise TimeoutError(
                    f"the worker did not start within {timeout:.0f} s:\n{self.log.read_text()[-2000:]}"
                )
            time.sleep(0.2)


@contextlib.contextmanager
def worker_process(url: str, workdir: Path, model: str, fleet: str) -> Iterator[DemoWorker]:
    """Start a worker with the fleet file text ``fleet`` (after ``redis_url``); stop it on
    exit, or when this process dies, SIGKILL included (:func:`.tied_popen`). It is not
    waited for: call ``wait_ready``."""
    config = workdir / f"{model}.toml"
    config.write_text(f'redis_url = "{url}"\n\n{fleet}')
    log = workdir / f"{model}-worker.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    name = f"demo-{model}-{os.getpid()}"
    cmd = [sys.executable, "-m", "batchfleet", "worker", "--config", str(config), "--name", name]
    with log.open("wb") as out:
        proc = tied_popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield DemoWorker(proc, name, model, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
