"""A model stand-in for the scaling benchmark: a batch costs 20 ms + 1 ms per row of sleep
(no CPU), so throughput measures the fleet (Redis, loop, scaling), not a model."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfleet.worker.runner import BatchRunner, Encoded

BASE_S = 0.020
PER_ROW_S = 0.001


class SleepHandler(BatchRunner):
    name = "sleep"

    def __init__(self, path: Path, *, device: str = "cpu", **_: Any) -> None:
        self.device = "cpu"

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        return [Encoded(ids=tuple(range(len(t.split()) + 2)), type_ids=(), truncated=False)
                for t in texts]  # fmt: skip

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        time.sleep(BASE_S + PER_ROW_S * len(rows))
        return [len(r.ids) for r in rows]

    def info(self) -> dict[str, Any]:
        return {"device": "cpu", "cost": "20 ms + 1 ms/row (sleep)"}
