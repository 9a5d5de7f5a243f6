"""The markdown report, its plots, the issue's targets, and the machine facts."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import subprocess
from pathlib import Path

import redis

from .offline import Offline
from .stats import Summary

Results = dict[str, tuple[Offline, list[Summary], list[str]]]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_facts(url: str) -> dict[str, str]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    server = redis.Redis.from_url(url).info("server")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, check=False).stdout.strip()  # fmt: skip
    except OSError:
        commit = "?"
    return {
        "cores": f"{os.cpu_count()} ({cpu})",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "torch threads": "1 per worker (OMP_NUM_THREADS=1; offline limit: torch.set_num_threads(1))",
        "python": platform.python_version(),
        "redis-server": str(server.get("redis_version")),
        "versions": ", ".join(
            f"{d} {_version(d)}"
            for d in (
                "batchfleet",
                "celery",
                "celery-batches",
                "kombu",
                "redis",
                "torch",
                "transformers",
                "msgpack",
                "pydantic",
            )
        ),
        "git commit": commit or "?",
    }


def _ms(x: float) -> str:
    return (
        "-" if math.isnan(x) else (f"{x:.2f}" if x < 10 else f"{x:.0f}" if x >= 100 else f"{x:.1f}")
    )


def table(offline: Offline, rows: list[Summary]) -> list[str]:
    lanes = max((len(s.lane_p99_ms) for s in rows), default=3)
    lane_cols = " | ".join(f"lane {i} p99" for i in range(lanes))
    out = [
        f"| system | offered/s | n | achieved/s | steady/s | % of limit | p50 ms | p95 ms | p99 ms | "
        f"{lane_cols} | lost | failed | batch mean / p50 / max | batch sizes | padding waste |",
        "|" + " --- |" * (15 + lanes - 1),
    ]
    for s in rows:
        hist = " ".join(f"{k}:{v}" for k, v in s.batch_hist.items())
        lane_vals = " | ".join(_ms(x) for x in s.lane_p99_ms)
        share = s.steady / offline.throughput if offline.throughput else float("nan")
        out.append(
            f"| {s.system} | {s.offered:g} | {s.n} | {s.achieved:,.0f} | {s.steady:,.0f} | "
            f"{share:.0%} | "
            f"{_ms(s.p50_ms)} | {_ms(s.p95_ms)} | {_ms(s.p99_ms)} | {lane_vals} | {s.lost} | "
            f"{s.failed} | {s.batch_mean:.1f} / {s.batch_p50:g} / {s.batch_max} | {hist} | "
            f"{s.padding_waste:.0%} |"
        )
    split = [s for s in rows if s.server_p50_ms]
    if split:
        out += ["", "batchfleet's own timings (p50, ms, Redis clock; enqueue is the stream id's "
                "millisecond) beside the end-to-end p50, and the producer's lag behind the "
                "schedule (p99, ms):", "",
                "| system | offered/s | queued | batch wait | inference (batch run) | "
                "enqueue → computed | e2e p50 | producer lag p99 |", "|" + " --- |" * 8]  # fmt: skip
        for s in split:
            q, w, i, t = s.server_p50_ms or (0, 0, 0, 0)
            out.append(f"| {s.system} | {s.offered:g} | {_ms(q)} | {_ms(w)} | {_ms(i)} | "
                       f"{_ms(t)} | {_ms(s.p50_ms)} | {_ms(s.lag_p99_ms)} |")  # fmt: skip
    return out


def _find(rows: list[Summary], system: str, rate: float | None = None) -> Summary | None:
    found = [s for s in rows if s.system == system and (rate is None or s.offered == rate)]
    return found[-1] if found else None


def targets(results: Results) -> list[str]:
    """The issue's targets, each as a table row: target, measured, met?"""
    out = ["| model | target | measured (same run) | met |", "| --- | --- | --- | --- |"]

    def row(model: str, target: str, measured: str, ok: bool | None) -> None:
        mark = "n/a" if ok is None else ("yes" if ok else "**no**")
        out.append(f"| {model} | {target} | {measured} | {mark} |")

    if "synthetic" in results:
        off, rows, _ = results["synthetic"]
        top = max(s.offered for s in rows)
        bf, ce, cb = (_find(rows, n, top) for n in ("batchfleet", "celery", "celery-batches"))
        if bf:
            row("synthetic", "saturation ≥ 97% of the limit",
                f"{bf.steady:,.0f} / {off.throughput:,.0f} req/s = {bf.steady / off.throughput:.1%}"
                f" (first submit → last result: {bf.achieved / off.throughput:.1%})",
                bf.steady >= 0.97 * off.throughput)  # fmt: skip
        if bf and ce:
            row("synthetic", "≥ 10x a Celery task per request",
                f"{bf.steady:,.0f} / {ce.steady:,.0f} = {bf.steady / ce.steady:.1f}x",
                bf.steady >= 10 * ce.steady)  # fmt: skip
        if bf and cb:
            row("synthetic", "≥ 2.5x celery-batches at ≤ its p99",
                f"{bf.steady / cb.steady:.2f}x; p99 {_ms(bf.p99_ms)} vs {_ms(cb.p99_ms)} ms",
                bf.steady >= 2.5 * cb.steady and bf.p99_ms <= cb.p99_ms)  # fmt: skip
        low = _find(rows, "batchfleet", 5)
        if low:
            cbl = _find(rows, "celery-batches", 5)
            extra = f" (celery-batches {_ms(cbl.p50_ms)} ms)" if cbl else ""
            row("synthetic", "p50 ≤ 22 ms at 5 req/s", f"{_ms(low.p50_ms)} ms{extra}",
                low.p50_ms <= 22)  # fmt: skip
    if "noop" in results:
        _, rows, _ = results["noop"]
        bfs = [s for s in rows if s.system == "batchfleet"]
        if bfs:
            best = max(bfs, key=lambda s: s.steady)
            ce = [s for s in rows if s.system == "celery"]
            extra = f" (Celery per request: {max(s.steady for s in ce):,.0f})" if ce else ""
            row("noop", "one worker ≥ 20,000 req/s",
                f"{best.steady:,.0f} req/s at {best.offered:g} offered{extra}",
                best.steady >= 20_000)  # fmt: skip
        low = _find(rows, "batchfleet", 1000)
        if low:
            ce = _find(rows, "celery", 1000)
            extra = f" (Celery per request {_ms(ce.p50_ms)} ms)" if ce else ""
            row("noop", "p50 ≤ 1 ms at 1,000 req/s", f"{_ms(low.p50_ms)} ms{extra}",
                low.p50_ms <= 1.0)  # fmt: skip
    if "minilm" in results:
        off, rows, _ = results["minilm"]
        bfs = [s for s in rows if s.system == "batchfleet"]
        if bfs:
            best = max(bfs, key=lambda s: s.steady)
            row("minilm", "≥ 95% of the offline best",
                f"{best.steady:.1f} / {off.throughput:.1f} req/s = {best.steady / off.throughput:.0%}",
                best.steady >= 0.95 * off.throughput)  # fmt: skip
    return out


COLORS = {"batchfleet": "C0", "batchfleet-fixed": "C1", "celery": "C3", "celery-batches": "C2"}


def plots(out: Path, stem: str, model: str, offline: Offline, rows: list[Summary]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(s.system for s in rows))
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in systems:
        ss = sorted((s for s in rows if s.system == name), key=lambda s: s.offered)
        x = [s.steady for s in ss]
        ax.plot(x, [s.p99_ms for s in ss], "o-", color=COLORS.get(name), label=f"{name} p99")
        ax.plot(x, [s.p50_ms for s in ss], "x--", color=COLORS.get(name), alpha=0.6,
                label=f"{name} p50")  # fmt: skip
    ax.axvline(offline.throughput, color="k", lw=0.8, ls=":", label="offline limit")
    ax.set(xscale="log", yscale="log", xlabel="achieved throughput (req/s)",
           ylabel="end-to-end latency (ms)", title=f"{model}: latency vs throughput")  # fmt: skip
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    p = out / f"{stem}-{model}-latency.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(1, len(systems), figsize=(3.2 * len(systems), 3.4), sharey=True,
                             squeeze=False)  # fmt: skip
    for ax, name in zip(axes[0], systems, strict=True):
        ss = sorted((s for s in rows if s.system == name), key=lambda s: s.offered)
        for lane in range(max(len(s.lane_p99_ms) for s in ss)):
            ax.plot([s.offered for s in ss], [s.lane_p99_ms[lane] for s in ss], "o-",
                    label=f"lane {lane}")  # fmt: skip
        ax.set(xscale="log", yscale="log", title=name, xlabel="offered (req/s)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("p99 submit → result (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{model}: per-lane p99 wait (end to end)")
    fig.tight_layout()
    p = out / f"{stem}-{model}-lanes.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def write_report(out: Path, stem: str, results: Results, facts: dict[str, str],
                 plots_on: bool = True, *, plots: bool | None = None) -> Path:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    want_plots = plots_on if plots is None else plots
    lines = [f"# Benchmark {stem}", "", f"`{facts.get('command', 'python -m bench')}`", ""]
    lines += ["Latency is submit → result visible to the producer, on one clock (the harness's",
              "`perf_counter`): submitted from one thread at Poisson arrival times (open loop),",
              "results timestamped by a second thread as they are pushed (batchfleet: the",
              "producer's reply channel; Celery: the result backend's pub/sub). Throughput:",
              "*achieved* = ok results / (first submit → last result); *steady* = completions",
              "per second between the 10th and 90th percentile completion (start-up and drain",
              "left out, like the offline limit); targets and \"% of limit\" use *steady*.",
              "Compare ratios within this run: the machine is shared and noisy.", ""]  # fmt: skip
    lines += ["## Targets", "", *targets(results), ""]
    from .models import MODELS

    for model, (offline, rows, notes) in results.items():
        spec = MODELS[model]
        max_batch = facts.get("max batch override") or spec.max_batch
        lines += [f"## {model}: {spec.cost}, max batch {max_batch}", "",
                  f"Offline limit (batches back to back, no queue): **{offline.throughput:,.1f} "
                  f"req/s** ({offline.detail}).", ""]  # fmt: skip
        lines += [*table(offline, rows), ""]
        lines += [f"- {n}" for n in notes] + ([""] if notes else [])
        if want_plots and rows:
            for p in plots_fn(out, stem, model, offline, rows):
                lines += [f"![{p.stem}]({p.name})", ""]
    lines += ["## Machine", ""] + [f"- {k}: {v}" for k, v in facts.items()] + [""]
    path = out / f"{stem}.md"
    path.write_text("\n".join(lines))
    return path


plots_fn = plots
