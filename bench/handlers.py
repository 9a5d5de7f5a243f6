"""Model stand-ins for the benchmark, loaded by workers as ``bench.handlers:Name``.

``SleepHandler`` (GPU-like: 20 ms + 1 ms per row of sleep, no CPU) is the scaling
bench's; ``NoopHandler`` does nothing, so only the queue path is measured. Both count
tokens as words + 2 (like a tokenizer's [CLS] … [SEP]), so padding waste is comparable.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfleet.worker.runner import BatchRunner, Encoded

from .sleep_handler import SleepHandler

__all__ = ["NoopHandler", "SleepHandler", "word_tokens"]


def word_tokens(text: str) -> int:
    return len(text.split()) + 2


class NoopHandler(BatchRunner):
    name = "noop"

    def __init__(self, path: Path, *, device: str = "cpu", **_: Any) -> None:
        self.device = "cpu"

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        return [Encoded(ids=tuple(range(word_tokens(t))), type_ids=(), truncated=False)
                for t in texts]  # fmt: skip

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        return [0] * len(rows)

    def info(self) -> dict[str, Any]:
        return {"device": "cpu", "cost": "none"}
