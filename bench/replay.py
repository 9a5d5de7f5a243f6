"""In-process replay: a MiniLM Poisson trace through the batching engine, real batch times.

The simulator (``batching.simulator``) drives the engine in virtual time, but each batch
it forms is run on the real model (encode + forward, as a worker's handler does) and
the clock advances by the measured time. No Redis, no worker loop, no harness: this
measures the engine's choices (composition, batch size, padding) against the offline
limit, measured in the same process, without the CPU contention of the full benchmark.

Run: ``.venv/bin/python bench/replay.py [--rate 160] [-n 400] [--max-batch 32]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchfleet.batching.report import SimReport
from batchfleet.batching.simulator import simulate
from batchfleet.batching.types import Batch, Policy, Waiting

from bench.load import corpus, poisson_load
from bench.models import MODELS, ModelSpec
from bench.offline import Offline, offline_limit


@dataclass
class ModelCost:
    """A batch's time is the real handler's encode + run of its texts, measured."""

    handler: Any
    texts: dict[str, str]
    a: float = 0.0
    spent: list[float] = field(default_factory=list)

    def seconds(self, batch: Batch, rng: random.Random) -> float:
        texts = [self.texts[w.key] for w in batch.items]
        t0 = time.perf_counter()
        self.handler.run(self.handler.encode(texts))
        took = time.perf_counter() - t0
        self.spent.append(took)
        return took


def trace(spec: ModelSpec, rate: float, n: int) -> tuple[list[Waiting], dict[str, str]]:
    """The benchmark's load (same seed) as engine requests, token counts as the worker's."""
    load = poisson_load(rate, n)
    items = [
        Waiting(f"r{k:05}", load.lanes[k], load.at[k], spec.tokens(load.texts[k]))
        for k in range(load.n)
    ]
    return items, {w.key: load.texts[k] for k, w in enumerate(items)}


def replay(
    spec: ModelSpec, rate: float, n: int, policy: Policy, handler: Any | None = None
) -> SimReport:
    """Run the trace through one engine in virtual time, batches on the real model."""
    handler = handler or spec.load()
    items, texts = trace(spec, rate, n)
    handler.run(handler.encode(list(texts.values())[:4]))  # warm-up
    return simulate(items, policy, ModelCost(handler, texts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=160.0, help="offered req/s (Poisson)")
    p.add_argument("-n", type=int, default=400, help="requests")
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--no-offline", action="store_true", help="skip the offline limit")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)
    spec = MODELS["minilm"]
    policy = Policy(max_batch_size=args.max_batch or spec.max_batch)
    handler = spec.load()
    offline: Offline | None = None
    if not args.no_offline:
        offline = offline_limit(spec, corpus(256), quick=False)
        print(f"offline limit: {offline.throughput:.1f} req/s ({offline.detail})")
    r = replay(spec, args.rate, args.n, policy, handler)
    print(r.format())
    if offline is not None:
        print(
            f"\nreplay {r.throughput:.1f} req/s = {r.throughput / offline.throughput:.1%} of offline"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
