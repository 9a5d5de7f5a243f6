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
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
from batchfleet.producer import Producer
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runner import StepReport, Work

from batchfleet.config import ModelConfig, WorkerConfig
from batchfleet.redis_server import LocalRedis
from bench.load import corpus
from bench.sleep_handler import BASE_S, PER_ROW_S, SleepHandler


class TimedSleep(SleepHandler):
    """The sleep model, timing each step on the device thread."""

    def __init__(self) -> None:
        super().__init__(Path("/unused"))
        self.spans: list[tuple[float, float, int]] = []

    def step(self, work: Work) -> StepReport:
        t0 = time.perf_counter()
        report = super().step(work)
        self.spans.append((t0, time.perf_counter(), sum(p.rows for _, p in work.admit)))
        return report


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1500
    runner = TimedSleep()
    with LocalRedis() as url:
        client = redis.Redis.from_url(url)
        producer = Producer(client=client)
        texts = corpus(n)
        for lane in range(3):
            producer.submit_many("sleep", texts[lane::3], priority=lane)
        cfg = ModelConfig(batch={"max_batch_size": 32})
        loop = BatchLoop("sleep", cfg, runner, client, consumer="g1",
                         worker=WorkerConfig(block_ms=50), burst=True)  # fmt: skip
        loop.run()
    spans = runner.spans
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
