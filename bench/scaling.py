"""Throughput at saturation with 1, 2 and 4 worker processes (sleep-based handler).

    .venv/bin/python bench/scaling.py [--requests 6000] [--workers 1 2 4]

Each round starts a fresh set of `batchfleet worker` processes on a private redis-server,
submits the whole backlog at once (saturation), and measures requests per second from the
first enqueue to the last stored result (Redis clock: stream ids and ``finished_at_ms``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from batchfleet.producer import Producer
from batchfleet.schemas.keys import ModelKeys

from batchfleet.redis_server import LocalRedis

HERE = Path(__file__).resolve().parent

FLEET = """redis_url = "{url}"
[worker]
block_ms = 100
[metrics]
enabled = false
[models.sleepy]
handler = "sleep_handler:SleepHandler"
path = "{path}"
max_tokens = 64
[models.sleepy.batch]
max_batch_size = {batch}
max_wait_ms = 5
"""


def run_round(url: str, workers: int, requests: int, batch: int, tmp: Path) -> float:
    client = redis.Redis.from_url(url)
    client.flushall()
    config = tmp / "fleet.toml"
    config.write_text(FLEET.format(url=url, path=HERE, batch=batch))
    env = dict(os.environ, PYTHONPATH=str(HERE), OMP_NUM_THREADS="1")
    procs = []
    for i in range(workers):
        argv = [sys.executable, "-m", "batchfleet", "worker", "--config", str(config),
                "--name", f"bench{i}", "--loglevel", "WARNING"]  # fmt: skip
        log = (tmp / f"w{i}.log").open("wb")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log))
    try:
        keys = ModelKeys("sleepy")
        while client.hlen(keys.workers) < workers:
            time.sleep(0.1)
        with Producer(url) as producer:
            jobs = producer.submit_many("sleepy", [f"text number {i}" for i in range(requests)])
            results = list(producer.results(jobs, timeout=600))
        assert all(r.ok for r in results), "all answered ok"
        first = min(r.finished_at_ms - r.timings.total_ms for r in results)
        last = max(r.finished_at_ms for r in results)
        per_worker = {}
        for r in results:
            per_worker[r.timings.worker] = per_worker.get(r.timings.worker, 0) + 1
        mean_batch = sum(r.timings.batch_size for r in results) / len(results)
        rate = requests / ((last - first) / 1000)
        print(f"{workers} worker(s): {rate:7.0f} req/s  mean batch {mean_batch:5.1f}  "
              f"per worker {sorted(per_worker.values())}", flush=True)  # fmt: skip
        return rate
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    rates = {}
    with LocalRedis() as url, tempfile.TemporaryDirectory() as tmp:
        for n in args.workers:
            rates[n] = run_round(url, n, args.requests, args.batch, Path(tmp))
    base = rates[args.workers[0]]
    for n, rate in rates.items():
        print(f"scaling {args.workers[0]} -> {n}: {rate / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
