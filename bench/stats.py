"""Summaries of one run: throughput, latency percentiles, per lane, batches, padding."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchfleet.batching.report import percentile

from .systems import Run


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values; NaN when empty."""
    return percentile(sorted(values), q, empty=float("nan"))


@dataclass(frozen=True, slots=True)
class Summary:
    system: str
    offered: float
    n: int
    achieved: float
    """ok results / (first submit → last result): start-up and drain included."""
    steady: float
    """ok results / time in steady state: between the 10th and 90th percentile completion."""
    p50_ms: float
    p95_ms: float
    p99_ms: float
    lane_p99_ms: tuple[float, ...]
    lost: int
    failed: int
    batch_mean: float
    batch_p50: float
    batch_max: int
    batch_hist: dict[str, int]
    padding_waste: float
    lag_p99_ms: float
    timed_out: bool
    server_p50_ms: tuple[float, float, float, float] | None = None
    """batchfleet: p50 of queued, batch wait, inference, enqueue → stored (Redis clock)."""


def steady_rate(done: Sequence[float], lo: float = 0.1, hi: float = 0.9) -> float:
    """Completions per second between the ``lo`` and ``hi`` quantiles of completion time.

    The offline limit is a steady-state rate (batches back to back, no start-up, no
    drain); this is the same measure for a system: its first batches (the window
    opening, the cost model learning) and its last, partial one are left out. With
    fewer than 20 completions it falls back to all of them."""
    t = sorted(done)
    if len(t) < 2:
        return 0.0
    i, j = (int(lo * (len(t) - 1)), int(hi * (len(t) - 1))) if len(t) >= 20 else (0, len(t) - 1)
    return (j - i) / (t[j] - t[i]) if t[j] > t[i] else 0.0


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _bucket(size: int) -> str:
    lo = 1
    for b in BUCKETS:
        if size <= b:
            return str(b) if b == lo else f"{lo}-{b}"
        lo = b + 1
    return f">{BUCKETS[-1]}"


def summarize(run: Run, tokens: Callable[[str], int]) -> Summary:
    load = run.load
    lat = [(d - s) * 1e3 for s, d in zip(run.submitted, run.done, strict=True) if d is not None]
    lanes = max(load.lanes, default=0) + 1
    per_lane: list[list[float]] = [[] for _ in range(lanes)]
    for k, d in enumerate(run.done):
        if d is not None:
            per_lane[load.lanes[k]].append((d - run.submitted[k]) * 1e3)
    done = [d for d in run.done if d is not None]
    span = (max(done) - min(run.submitted)) if done else 0.0
    ok = sum(1 for k, d in enumerate(run.done) if d is not None and run.ok[k])
    lost = sum(1 for d in run.done if d is None)
    failed = sum(1 for k, d in enumerate(run.done) if d is not None and not run.ok[k])
    # Batches as the worker formed them: members of one batch id; size as it reported.
    members: dict[str, list[int]] = defaultdict(list)
    sizes: list[int] = []
    for k, bid in enumerate(run.batch_id):
        if run.done[k] is None:
            continue
        if bid:
            members[bid].append(k)
        else:
            sizes.append(max(1, run.batch[k]))
    real = padded = 0
    for ks in members.values():
        sizes.append(max(run.batch[ks[0]], len(ks)))
        toks = [tokens(load.texts[k]) for k in ks]
        real += sum(toks)
        padded += max(toks) * len(toks)
    hist = Counter(_bucket(s) for s in sizes)
    return Summary(
        system=run.system,
        offered=load.rate,
        n=load.n,
        achieved=ok / span if span > 0 else 0.0,
        steady=steady_rate([d for k, d in enumerate(run.done) if d is not None and run.ok[k]]),
        p50_ms=pct(lat, 50),
        p95_ms=pct(lat, 95),
        p99_ms=pct(lat, 99),
        lane_p99_ms=tuple(pct(v, 99) for v in per_lane),
        lost=lost,
        failed=failed,
        batch_mean=sum(sizes) / len(sizes) if sizes else 0.0,
        batch_p50=pct(sizes, 50),
        batch_max=max(sizes, default=0),
        batch_hist=dict(sorted(hist.items(), key=lambda kv: int(kv[0].split("-")[0].lstrip(">")))),
        padding_waste=1 - real / padded if padded else 0.0,
        lag_p99_ms=pct(run.lag, 99) * 1e3,
        timed_out=run.timed_out,
        server_p50_ms=tuple(pct([x[i] for x in run.server], 50) for i in range(4))  # type: ignore[arg-type]
        if run.server
        else None,
    )
