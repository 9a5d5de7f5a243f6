"""The offline limit: the model's batches run back to back, no queue, in this process."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .models import ModelSpec


@dataclass(frozen=True, slots=True)
class Offline:
    throughput: float
    """Best requests per second over the tried configurations."""
    detail: str


def offline_limit(spec: ModelSpec, texts: list[str], quick: bool) -> Offline:
    """Encode + run ``texts`` in batches back to back; the best of a few batch shapes.

    Length-sorted orders sort by token count, so the limit is the best this model does
    offline with no padding to speak of (sorting by characters leaves about 5% on the table).
    """
    import torch

    torch.set_num_threads(1)  # as the workers run (OMP_NUM_THREADS=1)
    handler = spec.load()
    if spec.name == "minilm":
        n = 48 if quick else 160
        # Sorted by token count (what a batch is padded to), at the sizes that do best on
        # CPU, and batch 32 in arrival order for reference.
        shapes = [(8, True), (16, True), (32, True), (32, False)] if not quick else [(32, True)]
    else:
        n = spec.max_batch * (4 if quick else 20)
        shapes = [(spec.max_batch, False)]
    texts = (texts * (n // max(1, len(texts)) + 1))[:n]
    handler.run(handler.encode(texts[: min(4, n)]))  # warm-up
    results = []
    tokens = {t: e.tokens for t, e in zip(texts, handler.encode(texts), strict=True)}
    for size, by_length in shapes:
        order = sorted(texts, key=lambda t: (tokens[t], t)) if by_length else texts
        t0 = time.perf_counter()
        for i in range(0, n, size):
            handler.run(handler.encode(order[i : i + size]))
        rate = n / (time.perf_counter() - t0)
        results.append((rate, f"batch {size}{', length-sorted' if by_length else ''}"))
    best = max(results)
    detail = "; ".join(f"{name}: {rate:,.0f}/s" for rate, name in results)
    return Offline(best[0], detail)
