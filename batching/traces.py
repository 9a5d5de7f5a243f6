"""Arrival traces for the simulator: Poisson, bursts, lane mixes, 5-60-word lengths.

A trace is a list of :class:`~.types.Waiting`, sorted by ``arrived``, with unique keys.
Every generator takes a ``seed`` so a run is reproducible.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence

from .types import Waiting

Trace = list[Waiting]

WORDS_MIN = 5
WORDS_MAX = 60
WORDS_MEDIAN = 15.0
WORDS_SIGMA = 0.6
"""Word counts are log-normal (median 15 words, a long tail), clipped to 5-60: most
inputs are a sentence or two, a few are paragraphs — like search queries and chat turns."""


def words_to_tokens(words: int) -> int:
    """Sub-word tokens for ``words`` English words, plus the two special tokens."""
    return int(words * 1.3 + 0.5) + 2


def sample_tokens(rng: random.Random) -> int:
    """One token length drawn from the 5-60-word distribution."""
    words = rng.lognormvariate(math.log(WORDS_MEDIAN), WORDS_SIGMA)
    return words_to_tokens(min(WORDS_MAX, max(WORDS_MIN, round(words))))


def poisson(
    n: int,
    rate: float,
    *,
    lanes: Sequence[float] = (1.0,),
    tokens: int | None = None,
    deadline_ms: float | None = None,
    start: float = 0.0,
    seed: int = 0,
    prefix: str = "r",
) -> Trace:
    """``n`` requests arriving as a Poisson process of ``rate`` per second.

    ``lanes``: relative share of each lane (lane i gets ``lanes[i]``); ``tokens``:
    every request this long (None: the 5-60-word distribution); ``deadline_ms``:
    each request's deadline after its arrival (None: no deadlines).
    """
    return _generate(n, lambda t: rate, rate, lanes, tokens, deadline_ms, start, seed, prefix)


def bursts(
    n: int,
    base_rate: float,
    burst_rate: float,
    *,
    period_s: float = 1.0,
    burst_s: float = 0.1,
    lanes: Sequence[float] = (1.0,),
    tokens: int | None = None,
    deadline_ms: float | None = None,
    start: float = 0.0,
    seed: int = 0,
    prefix: str = "b",
) -> Trace:
    """Poisson arrivals at ``base_rate``, jumping to ``burst_rate`` for the first
    ``burst_s`` of every ``period_s``."""

    def rate_at(t: float) -> float:
        return burst_rate if (t - start) % period_s < burst_s else base_rate

    peak = max(base_rate, burst_rate)
    return _generate(n, rate_at, peak, lanes, tokens, deadline_ms, start, seed, prefix)


def merge(*traces: Trace) -> Trace:
    """One trace of several (e.g. one per lane at its own rate); keys must not collide."""
    return list(heapq.merge(*traces, key=lambda w: w.arrived))


def _generate(
    n: int,
    rate_at: Callable[[float], float],
    peak: float,
    lanes: Sequence[float],
    tokens: int | None,
    deadline_ms: float | None,
    start: float,
    seed: int,
    prefix: str,
) -> Trace:
    if peak <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    total = sum(lanes)
    cumulative = []
    acc = 0.0
    for share in lanes:
        acc += share / total
        cumulative.append(acc)
    out: Trace = []
    t = start
    while len(out) < n:
        t += rng.expovariate(peak)  # thinning: accept with rate(t) / peak
        if rng.random() * peak > rate_at(t):
            continue
        u = rng.random()
        lane = next((i for i, c in enumerate(cumulative) if u <= c), len(lanes) - 1)
        length = tokens if tokens is not None else sample_tokens(rng)
        deadline = None if deadline_ms is None else t + deadline_ms / 1000.0
        out.append(Waiting(f"{prefix}{len(out)}", lane, t, length, 1, deadline))
    return out
