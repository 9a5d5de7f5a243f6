"""The worker's own cost per request: pre-queue N no-op requests, run one batch loop in
this process until the streams are drained (burst mode), report rate and CPU per request.

No Celery, no harness, no pub/sub listener: what is left is the loop's read → decode →
plan → publish path. Profile it with ``py-spy record -o out.txt -f raw -- python
bench/profile_loop.py 60000``.

Run: ``.venv/bin/python bench/profile_loop.py [N] [--max-batch 256]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
from batchfleet.producer import Producer
from batchfleet.worker.loop import BatchLoop

from batchfleet.config import ModelConfig, WorkerConfig
from batchfleet.redis_server import LocalRedis
from bench.handlers import NoopHandler
from bench.load import corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("n", type=int, nargs="?", default=20_000)
    p.add_argument("--max-batch", type=int, default=256)
    args = p.parse_args()
    texts = corpus(1000)
    with LocalRedis() as url:
        client = redis.Redis.from_url(url)
        producer = Producer(client=client)
        t0 = time.perf_counter()
        for start in range(0, args.n, len(texts)):
            chunk = texts[: min(len(texts), args.n - start)]
            for lane in range(3):
                producer.submit_many("noop", chunk[lane::3], priority=lane)
        t1 = time.perf_counter()
        print(f"submit_many: {args.n} in {t1 - t0:.2f} s ({(t1 - t0) / args.n * 1e6:.1f} µs each)")
        cfg = ModelConfig(batch={"max_batch_size": args.max_batch})
        loop = BatchLoop("noop", cfg, NoopHandler(Path("/unused")), client, consumer="p1",
                         worker=WorkerConfig(block_ms=50), burst=True)  # fmt: skip
        c0, t0 = time.process_time(), time.perf_counter()
        loop.run()
        t1, c1 = time.perf_counter(), time.process_time()
        snap = loop.stats.snapshot()
        print(
            f"loop: {snap['requests']} in {t1 - t0:.2f} s = {args.n / (t1 - t0):,.0f}/s; "
            f"CPU {(c1 - c0) / args.n * 1e6:.1f} µs per request; {snap['batches']} batches "
            f"(the end includes about 0.1 s of idle reads before burst mode stops)"
        )


if __name__ == "__main__":
    main()
