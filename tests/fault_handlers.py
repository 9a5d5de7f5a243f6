"""Handlers that misbehave on purpose, for the fault tests (loaded by worker processes
through ``handler = "fault_handlers:FaultyEmbedder"`` with tests/ on PYTHONPATH).

A real GPU cannot be made to run out of memory on this CPU machine, so out-of-memory is
raised as torch's own ``OutOfMemoryError`` above a row count, as a real CUDA model would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from batchfleet.worker.runner import Encoded
from batchfleet.worker.runners.embedding import EmbeddingRunner


class FaultyEmbedder(EmbeddingRunner):
    """Options: ``batch_ms``/``row_ms`` (GPU-like sleep per batch), ``poison_text`` (raise),
    ``crash_text`` (kill the process), ``oom_above`` (OOM over this many rows)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        opts = self.options
        self.batch_s = float(opts.get("batch_ms", 0)) / 1000
        self.row_s = float(opts.get("row_ms", 0)) / 1000
        self.oom_above = int(opts.get("oom_above", 0))
        self.poison = self._ids(opts.get("poison_text"))
        self.crash = self._ids(opts.get("crash_text"))
        self.largest_run = 0

    def _ids(self, text: str | None) -> tuple[int, ...] | None:
        return None if not text else self.encode([text])[0].ids

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        ids = {r.ids for r in rows}
        if self.crash in ids:
            os._exit(13)  # like a segfault in a CUDA kernel: no cleanup, no ack
        if self.oom_above and len(rows) > self.oom_above:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {len(rows)} rows (fake)"
            )
        if self.poison in ids:
            raise RuntimeError("this input breaks the model")
        time.sleep(self.batch_s + self.row_s * len(rows))
        self.largest_run = max(self.largest_run, len(rows))
        return super().run(rows)
