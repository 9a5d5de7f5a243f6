"""The load: a deterministic corpus of 5-60-word texts, lanes, and Poisson arrival times."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (  # noqa: SIM905
    "the a of model queue batch worker stream redis latency request result token vector "
    "embedding sentence fleet lane priority deadline window device memory cost rate load "
    "fast slow small large first last every each some many few more less time data text "
    "answer system service client server python celery network cluster node shard replica "
    "throughput benchmark measure report plot table number value signal noise sample"
).split()

LANE_MIX = (0.2, 0.5, 0.3)
"""Share of requests on lanes 0 (highest), 1 and 2."""


@dataclass(frozen=True, slots=True)
class Load:
    """``n`` requests: offsets from the start (seconds), texts and lanes."""

    rate: float
    at: tuple[float, ...]
    texts: tuple[str, ...]
    lanes: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.at)


def corpus(n: int, seed: int = 7) -> list[str]:
    """``n`` texts of 5-60 words, the same for every system and run."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 60))) for _ in range(n)]


def poisson_load(rate: float, n: int, seed: int = 11) -> Load:
    """Open-loop Poisson arrivals at ``rate`` per second, mixed lanes, corpus texts."""
    rng = random.Random(seed * 1000 + int(rate))
    t = 0.0
    at: list[float] = []
    for _ in range(n):
        t += rng.expovariate(rate)
        at.append(t)
    lanes = rng.choices(range(len(LANE_MIX)), weights=LANE_MIX, k=n)
    return Load(rate, tuple(at), tuple(corpus(n, seed)), tuple(lanes))
