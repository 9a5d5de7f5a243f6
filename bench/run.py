"""``python -m bench``: every system under the same open-loop load, one report.

Starts its own redis-server; for each model (synthetic GPU-like cost, no-op, MiniLM on
CPU) measures the offline limit, then runs each system (batchfleet adaptive, batchfleet
fixed window, a Celery task per request, celery-batches) at each offered rate, and writes
``bench/results/<date>.md`` with tables and PNG plots. A system that falls below 85% of
the offered rate is saturated: its higher rates are skipped, except the last
(saturation) point, which every system runs with the same request count.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import redis
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batchfleet.redis_server import LocalRedis

from .load import corpus, poisson_load
from .models import MODELS, ModelSpec
from .offline import Offline, offline_limit
from .report import machine_facts, write_report
from .stats import Summary, summarize
from .systems import SYSTEMS, System

SATURATED = 0.85
WARMUP = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two rates, few requests (smoke run)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--scale", type=float, default=1.0, help="multiply every request count")
    p.add_argument("--max-batch", type=int, default=None,
                   help="override the models' max batch (and celery-batches' flush size)")  # fmt: skip
    p.add_argument("--drain-s", type=float, default=None,
                   help="wait this long for the last results (default 90, quick 30)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default=None, help="report file stem (default: today's date)")
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def run_model(
    spec: ModelSpec, args: argparse.Namespace, url: str, workdir: Path, progress: Progress
) -> tuple[Offline, list[Summary], list[str]]:
    rates = spec.quick_rates if args.quick else spec.rates
    drain = args.drain_s or (30.0 if args.quick else 90.0)
    client = redis.Redis.from_url(url)
    notes: list[str] = []
    bar = progress.add_task(f"{spec.name}: offline limit", total=None)
    offline = offline_limit(spec, corpus(256), args.quick)
    progress.remove_task(bar)
    total = sum(spec.count(r, args.quick, args.scale) for r in rates) * len(args.systems)
    bar = progress.add_task(spec.name, total=total)
    out: list[Summary] = []
    for name in args.systems:
        client.flushall()
        progress.update(bar, description=f"{spec.name} / {name}: starting")
        system: System = SYSTEMS[name](spec, url, workdir)
        system.start()
        try:
            # Warm-up at the first rate (not reported): loads the model, and the adaptive
            # engine learns its cost and the arrival rate it will first see.
            system.run(poisson_load(min(rates[0], 200), WARMUP, seed=99), drain)
            saturated_at: float | None = None
            for rate in rates:
                n = spec.count(rate, args.quick, args.scale)
                if saturated_at is not None and rate != rates[-1]:
                    progress.advance(bar, n)
                    continue
                progress.update(bar, description=f"{spec.name} / {name} @ {rate:g}/s")
                run = system.run(poisson_load(rate, n), drain, lambda k: progress.advance(bar, k))
                s = summarize(run, spec.tokens)
                out.append(s)
                if s.achieved < SATURATED * rate or s.lost:
                    saturated_at = saturated_at or rate
                if run.timed_out:  # a backlog is left: start afresh for the next rate
                    notes.append(f"{spec.name}/{name} @ {rate:g}/s: {s.lost} results missing "
                                 f"after {drain:.0f}s drain (counted lost)")  # fmt: skip
                    system.stop()
                    client.flushall()
                    system = SYSTEMS[name](spec, url, workdir)
                    system.start()
                time.sleep(0.3)
            if saturated_at is not None and saturated_at != rates[-1]:
                skipped = [r for r in rates if saturated_at < r < rates[-1]]
                if skipped:
                    notes.append(f"{spec.name}/{name}: saturated at {saturated_at:g}/s; "
                                 f"skipped {', '.join(f'{r:g}' for r in skipped)}/s")  # fmt: skip
        finally:
            system.stop()
    progress.remove_task(bar)
    client.close()
    return offline, out, notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.monotonic()
    stem = args.name or dt.date.today().isoformat() + ("-quick" if args.quick else "")
    results: dict[str, tuple[Offline, list[Summary], list[str]]] = {}
    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        facts = machine_facts(url)
        if args.max_batch:
            facts["max batch override"] = str(args.max_batch)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())  # fmt: skip
        try:
            with Progress(*columns, transient=True) as progress:
                for name in args.models:
                    spec = MODELS[name]
                    if args.max_batch:
                        spec = dataclasses.replace(spec, max_batch=args.max_batch)
                    results[name] = run_model(spec, args, url, Path(tmp), progress)
        except BaseException:
            keep = Path(tempfile.mkdtemp(prefix="bench-logs-"))
            for log in Path(tmp).glob("*.log"):
                shutil.copy(log, keep)
            print(f"worker logs kept in {keep}", file=sys.stderr)
            raise
    facts["wall time"] = f"{time.monotonic() - started:.0f} s"
    facts["command"] = "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_report(args.out, stem, results, facts, plots=not args.no_plots)
    print(path.read_text())
    print(f"report written to {path}")
    return 0
