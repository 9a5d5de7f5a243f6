"""Device idle time between batches at saturation: pre-queue N requests for the sleep
model (20 ms + 1 ms per row, no CPU), run one batch loop in this process until drained,
and time every batch on the device thread.

The gap between one batch's end and the next one's start is what the loop's hand-off
costs the device (the loop queues the next batch just before the running one ends).

Run: ``.venv/bin/python bench/device_gaps.py [N]``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
from batchfleet.producer import Producer
from batchfleet.worker import loop as loop_module
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runner import Encoded

from batchfleet.config import ModelConfig, WorkerConfig
from batchfleet.redis_server import LocalRedis
from bench.load import corpus
from bench.sleep_handler import BASE_S, PER_ROW_S, SleepHandler


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1500
    spans: list[tuple[float, float, int]] = []
    run_batch = loop_module.run_batch

    def timed(handler: Any, groups: Sequence[Sequence[Encoded]]) -> Any:
        t0 = time.perf_counter()
        out = run_batch(handler, groups)
        spans.append((t0, time.perf_counter(), sum(len(g) for g in groups)))
        return out

    loop_module.run_batch = timed  # type: ignore[assignment]
    with LocalRedis() as url:
        client = redis.Redis.from_url(url)
        producer = Producer(client=client)
        texts = corpus(n)
        for lane in range(3):
            producer.submit_many("sleep", texts[lane::3], priority=lane)
        cfg = ModelConfig(path="/unused", batch={"max_batch_size": 32})
        loop = BatchLoop("sleep", cfg, SleepHandler(Path("/unused")), client, consumer="g1",
                         worker=WorkerConfig(block_ms=50), burst=True)  # fmt: skip
        loop.run()
    gaps = sorted((b[0] - a[1]) * 1e3 for a, b in pairwise(spans))
    busy = sum(end - start for start, end, _ in spans)
    ideal = sum(BASE_S + PER_ROW_S * rows for _, _, rows in spans)
    print(
        f"{len(spans)} batches; device busy {busy:.3f} s (sleep alone {ideal:.3f} s); gaps "
        f"between batches p50 {gaps[len(gaps) // 2]:.2f} ms, max {gaps[-1]:.2f} ms, "
        f"sum {sum(gaps):.1f} ms"
    )


if __name__ == "__main__":
    main()
