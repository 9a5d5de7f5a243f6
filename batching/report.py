"""What a simulation run measured, and its readable table."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .types import Batch, Waiting


def percentile(sorted_values: Sequence[float], q: float, empty: float = 0.0) -> float:
    """Nearest-rank percentile (``q`` in 0…100) of already sorted values: the smallest value
    with at least ``q``% of the values at or below it (rank ``ceil(q/100 · n)``); ``empty``
    if there are none. The one rank rule of the package, the demo and the benchmarks."""
    if not sorted_values:
        return empty
    rank = math.ceil(q / 100.0 * len(sorted_values))
    return sorted_values[max(0, min(len(sorted_values) - 1, rank - 1))]


@dataclass(frozen=True, slots=True)
class LaneReport:
    """One lane's outcome. Latency: arrival → batch done; wait: arrival → dispatch."""

    lane: int
    completed: int
    expired: int
    throughput: float
    latency_p50: float
    latency_p99: float
    wait_p50: float
    wait_p99: float
    wait_max: float


@dataclass(frozen=True, slots=True)
class SimReport:
    """Throughput, latency and batching statistics of one simulated run (seconds)."""

    requests: int
    completed: int
    expired: int
    ooms: int
    stuck: int
    """Requests neither computed nor expired when the run ended (always 0 unless a bug)."""
    duration: float
    throughput: float
    latency_p50: float
    latency_p99: float
    wait_p50: float
    wait_p99: float
    lanes: tuple[LaneReport, ...]
    batches: int
    mean_batch_rows: float
    batch_rows: dict[int, int]
    padding_waste: float
    """Padded-token waste over the run: 1 - real tokens / padded tokens."""
    batch_waste_p50: float
    batch_waste_p99: float
    reasons: dict[str, int]
    plan_calls: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def lane(self, lane: int) -> LaneReport:
        for r in self.lanes:
            if r.lane == lane:
                return r
        raise KeyError(lane)

    def format(self) -> str:
        """A readable plain-text table of the run."""
        ms = 1000.0
        lines = [
            f"requests {self.requests}  completed {self.completed}  expired {self.expired}"
            f"  ooms {self.ooms}  stuck {self.stuck}",
            f"throughput {self.throughput:.1f} req/s over {self.duration:.2f} s"
            f"  latency p50 {self.latency_p50 * ms:.1f} ms  p99 {self.latency_p99 * ms:.1f} ms"
            f"  wait p50 {self.wait_p50 * ms:.1f} ms  p99 {self.wait_p99 * ms:.1f} ms",
            "",
            f"{'lane':>4} {'done':>8} {'expired':>8} {'req/s':>9} {'lat p50':>9} "
            f"{'lat p99':>9} {'wait p50':>9} {'wait p99':>9} {'wait max':>9}",
        ]
        for r in self.lanes:
            lines.append(
                f"{r.lane:>4} {r.completed:>8} {r.expired:>8} {r.throughput:>9.1f} "
                f"{r.latency_p50 * ms:>9.1f} {r.latency_p99 * ms:>9.1f} "
                f"{r.wait_p50 * ms:>9.1f} {r.wait_p99 * ms:>9.1f} {r.wait_max * ms:>9.1f}"
            )
        lines += [
            "",
            f"batches {self.batches}  mean rows {self.mean_batch_rows:.1f}"
            f"  padding waste {self.padding_waste:.1%}"
            f" (per batch p50 {self.batch_waste_p50:.1%}, p99 {self.batch_waste_p99:.1%})",
            "batch rows: " + _histogram(self.batch_rows),
            "reasons:    " + "  ".join(f"{k} {v}" for k, v in sorted(self.reasons.items())),
        ]
        return "\n".join(lines)


def _histogram(rows: dict[int, int]) -> str:
    if not rows:
        return "-"
    edges = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    bins: Counter[str] = Counter()
    for size, count in rows.items():
        lo = max((e for e in edges if e <= size), default=1)
        hi = next((e for e in edges if e > lo), lo * 2) - 1
        bins[f"{lo}" if lo == hi else f"{lo}-{hi}"] += count
    order = sorted(bins, key=lambda k: int(k.split("-")[0]))
    return "  ".join(f"{k}: {bins[k]}" for k in order)


def build_report(
    *,
    requests: int,
    dispatched: Sequence[tuple[Waiting, float, float]],
    expired: Sequence[Waiting],
    batches: Sequence[Batch],
    ooms: int,
    stuck: int,
    plan_calls: int,
    share_window: tuple[float, float] | None = None,
) -> SimReport:
    """Summarise ``dispatched`` (request, start, end) records and the batches run."""
    first = min((w.arrived for w, _, _ in dispatched), default=0.0)
    if expired:
        first = min(first, min(w.arrived for w in expired))
    last = max((end for _, _, end in dispatched), default=first)
    duration = max(last - first, 1e-9)
    lanes = sorted({w.lane for w, _, _ in dispatched} | {w.lane for w in expired})
    lane_reports = []
    for lane in lanes:
        done = [(w, s, e) for w, s, e in dispatched if w.lane == lane]
        lat = sorted(e - w.arrived for w, _, e in done)
        wait = sorted(s - w.arrived for w, s, _ in done)
        lane_reports.append(
            LaneReport(
                lane=lane,
                completed=len(done),
                expired=sum(1 for w in expired if w.lane == lane),
                throughput=len(done) / duration,
                latency_p50=percentile(lat, 50),
                latency_p99=percentile(lat, 99),
                wait_p50=percentile(wait, 50),
                wait_p99=percentile(wait, 99),
                wait_max=wait[-1] if wait else 0.0,
            )
        )
    lat = sorted(e - w.arrived for w, _, e in dispatched)
    wait = sorted(s - w.arrived for w, s, _ in dispatched)
    rows = Counter(b.rows for b in batches)
    padded = sum(b.padded_tokens for b in batches)
    real = sum(b.real_tokens for b in batches)
    per_batch = sorted(b.padding_waste for b in batches)
    extra: dict[str, float] = {}
    if share_window is not None:
        t0, t1 = share_window
        inside = Counter(w.lane for w, s, _ in dispatched if t0 <= s < t1)
        total = sum(inside.values()) or 1
        for lane in lanes:
            extra[f"share_lane{lane}"] = inside[lane] / total
    return SimReport(
        requests=requests,
        completed=len(dispatched),
        expired=len(expired),
        ooms=ooms,
        stuck=stuck,
        duration=duration,
        throughput=len(dispatched) / duration,
        latency_p50=percentile(lat, 50),
        latency_p99=percentile(lat, 99),
        wait_p50=percentile(wait, 50),
        wait_p99=percentile(wait, 99),
        lanes=tuple(lane_reports),
        batches=len(batches),
        mean_batch_rows=(sum(b.rows for b in batches) / len(batches)) if batches else 0.0,
        batch_rows=dict(rows),
        padding_waste=(1.0 - real / padded) if padded else 0.0,
        batch_waste_p50=percentile(per_batch, 50),
        batch_waste_p99=percentile(per_batch, 99),
        reasons=dict(Counter(b.reason for b in batches)),
        plan_calls=plan_calls,
        extra=extra,
    )
