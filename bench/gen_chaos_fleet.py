"""The processes of a generation chaos run (``bench.gen_chaos``) and the chaos done to
them: Redis (AOF) and the generating workers, each kill -9'd and restarted by a thread
that waits for a worker to be mid-generation; and their stop, graceful at a run's end,
at once (kill -9) when the run is interrupted.
"""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis
from batchfleet.schemas.keys import ModelKeys

from batchfleet.redis_server import LocalRedis

from .systems import ROOT

MODEL = "chaos"
OPTIONS = {"kv_cache_tokens": 4096, "page_size": 16, "step_tokens": 64, "max_running": 16}
"""The tests' small cache and step budgets (tests/conftest.py ``TINY_LM_OPTIONS``)."""


def tiny_lm(workdir: Path, hidden: int) -> Path:
    """The tests' tiny random Llama (``tests/tiny_models.py``), a little deeper."""
    sys.path.insert(0, str(ROOT / "tests"))
    tiny_models: Any = importlib.import_module("tiny_models")
    path: Path = tiny_models.make_causal_lm(workdir / "tiny-lm", layers=4, hidden=hidden)
    return path


class Fleet:
    """Redis (AOF) and the worker processes; kill -9 and restart either."""

    def __init__(
        self, workdir: Path, workers: int, appendfsync: str, worker_opts: str, hidden: int
    ) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[str] = []
        self.born: list[int] = []
        self.lives = 0
        lm = tiny_lm(workdir, hidden)
        self.redis = LocalRedis(appendonly=True, appendfsync=appendfsync)
        try:  # (no orphaned workers or Redis when the start fails or is interrupted)
            self.url = self.redis.start()
            self.config = workdir / "fleet.toml"
            options = "".join(f"{k} = {v}\n" for k, v in OPTIONS.items())
            self.config.write_text(
                f'redis_url = "{self.url}"\n[worker]\n{worker_opts}\n'
                f'[models.{MODEL}]\nrunner = "text-generation"\npath = "{lm}"\n'
                f"[models.{MODEL}.options]\n{options}"
            )
            self.r = redis.Redis.from_url(self.url, socket_timeout=5)
            for i in range(workers):
                self.names.append(f"w{i}")
                self.born.append(0)
                self.procs.append(self._start(i))
            self.wait_ready(self.READY_S)
        except BaseException:
            self.stop(at_once=True)
            raise

    READY_S = 600.0
    """How long the workers may take to start: loading torch and the model took over 2 min
    on a 2-core machine shared with other work."""

    def wait_ready(self, within_s: float) -> None:
        end = time.monotonic() + within_s
        while not all(self.ready(i) for i in range(len(self.procs))):
            if time.monotonic() > end:
                raise TimeoutError(f"workers not ready: see the logs in {self.workdir}")
            time.sleep(0.1)

    def _start(self, i: int) -> subprocess.Popen[bytes]:
        self.lives += 1
        name, self.born[i] = self.names[i], int(time.time() * 1000)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        log = (self.workdir / f"{name}.log").open("ab")
        argv = [sys.executable, "-m", "batchfleet", "worker", "--config", str(self.config),
                "--name", name, "--loglevel", "INFO"]  # fmt: skip
        return subprocess.Popen(argv, env=dict(os.environ, **env), stdout=log, stderr=log)

    def ready(self, i: int) -> bool:
        """Worker ``i`` is up and serving: it has beaten since it was started."""
        beat = self.r.hget(ModelKeys(MODEL).workers, self.names[i])
        return self.procs[i].poll() is None and beat is not None and int(beat) >= self.born[i]

    def streaming(self) -> dict[str, list[tuple[str, int]]]:
        """Requests each consumer is generating now, past their first delta: named by its
        ``started`` key, unanswered, the token stream's last entry a delta written since
        that consumer's process started; (request id, that delta's seq) each."""
        keys = ModelKeys(MODEL)
        held: list[tuple[str, str]] = []
        for key in self.r.scan_iter(match=keys.started("*"), count=1000):
            rid = key.decode().rsplit(":", 1)[1]
            name: Any = self.r.get(key)
            if name is not None:
                held.append((rid, name.decode()))
        pipe = self.r.pipeline(transaction=False)
        for rid, _ in held:
            pipe.exists(keys.result(rid))
            pipe.xrevrange(keys.tokens(rid), count=1)
        replies = pipe.execute()
        born = {name: self.born[i] for i, name in enumerate(self.names)}
        out: dict[str, list[tuple[str, int]]] = {}
        for (rid, name), answered, last in zip(held, replies[::2], replies[1::2], strict=True):
            if answered or not last or b"end" in last[0][1] or name not in born:
                continue
            if int(last[0][0].split(b"-")[0]) >= born[name]:
                out.setdefault(name, []).append((rid, int(last[0][1][b"seq"])))
        return out

    def unended(self, rid: str) -> bool:
        """Request ``rid`` has no result and its token stream no end (yet)."""
        keys = ModelKeys(MODEL)
        last: Any = self.r.xrevrange(keys.tokens(rid), count=1)
        return not self.r.exists(keys.result(rid)) and bool(last) and b"end" not in last[0][1]

    def kill_worker(self, i: int, rng: random.Random) -> str:
        """kill -9 worker ``i`` and start it again: under its name half the time (a
        container restarted in place takes back its entries), else under a new one."""
        self.procs[i].kill()
        self.procs[i].wait()
        if rng.random() < 0.5:
            self.names[i] = f"w{i}-{self.lives}"
        self.procs[i] = self._start(i)
        return self.names[i]

    def kill_redis(self, down_s: float) -> None:
        self.redis.crash()
        time.sleep(down_s)
        self.redis.start()

    def stop(self, at_once: bool = False) -> None:
        """Stop the workers, then Redis: gracefully (SIGTERM, then kill -9 after 30 s), or
        ``at_once`` (kill -9: a run interrupted or that failed to start keeps nothing of
        theirs). Every process is signalled before any is waited for; stopped ones are
        skipped, so a second call costs nothing."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            if at_once:
                p.kill()
            else:
                p.terminate()
        for p in live:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if at_once:
            self.redis.crash()
        self.redis.stop()


class Chaos(threading.Thread):
    """kill -9, every ``every`` s (±50%) until every request is answered, of a worker
    generating a request past its first delta (one that has served since it started),
    waited for where there is none, so every kill lands mid-generation; the worker
    restarted; ``worker_kills`` of them at most (0: no bound). kill -9 of Redis
    ``redis_kills`` times, spread over the ``span`` s of submits. Each event logged with
    its time; ``cut``: the requests a kill cut mid-generation (their streams must show a
    restart)."""

    POLL_S = 0.1

    def __init__(
        self, fleet: Fleet, every: float, redis_kills: int, span: float, seed: int,
        worker_kills: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.kills_left = worker_kills or -1
        self.fleet, self.every, self.span = fleet, every, span
        self.rng = random.Random(seed)
        self.redis_at = [span * (k + 1) / (redis_kills + 1) for k in range(redis_kills)]
        self.events: list[tuple[float, str]] = []
        self.outages: list[tuple[float, float]] = []
        self.cut: list[str] = []
        self.done = threading.Event()
        self._start = 0.0

    def run(self) -> None:
        self._start = time.monotonic()
        while not self.done.wait(self.every * self.rng.uniform(0.5, 1.5)):
            if self._redis_due():
                self.redis_at.pop(0)
                down = time.monotonic()
                self.fleet.kill_redis(1.0)
                self.outages.append((down, time.monotonic()))
                self.events.append((down - self._start, "kill -9 redis, restarted after 1 s"))
                continue
            while self.kills_left and not self._kill_mid_generation():
                if self.done.wait(self.POLL_S) or self._redis_due():
                    break

    def _redis_due(self) -> bool:
        return bool(self.redis_at) and time.monotonic() - self._start >= self.redis_at[0]

    def _kill_mid_generation(self) -> bool:
        """kill -9 a worker streaming a request now, if one is; whether one was."""
        fleet = self.fleet
        try:
            streaming = fleet.streaming()
            up = [i for i, name in enumerate(fleet.names) if name in streaming and fleet.ready(i)]
        except redis.RedisError:
            return False
        if not up:
            return False
        at = time.monotonic() - self._start
        victim = self.rng.choice(up)
        held = streaming[fleet.names[victim]]
        name = fleet.kill_worker(victim, self.rng)
        try:  # (dead now: what it had not ended stays unended until another attempt)
            cut = [(rid, seq) for rid, seq in held if fleet.unended(rid)]
        except redis.RedisError:
            cut = []
        self.cut += [rid for rid, _ in cut]
        self.kills_left -= 1
        what = ", ".join(f"{rid} after seq {seq}" for rid, seq in cut) or "(all ended meanwhile)"
        self.events.append((at, f"kill -9 worker {victim} mid-generation of {what}, "
                                f"restarted as {name}"))  # fmt: skip
        return True
