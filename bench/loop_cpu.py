"""``python -m bench.loop_cpu``: the generating loop thread's CPU per step, by part, in
thread CPU time (``time.thread_time``: numbers a noisy, shared host leaves mostly alone).

A real ``BatchLoop`` serves the tiny Llama (the generation benchmark's runner and options)
from a real Redis, in this process, with the observers a worker runs (the queue and
step statistics, Prometheus and vLLM metrics, Flower task events into a queue, the
recent rate). ``--requests`` streaming requests are queued first, more than
``--running`` (the runner's ``max_running``) so the engine stays full and requests wait:
the loop runs saturated as in the fleet benchmark. Each part below is the loop thread's
CPU inside one of its calls, summed over the run and divided by its steps; parts nest
(indented), and ``other`` is the loop's thread CPU outside every part (its inbox, the
loop's own code). ``--profile``: one more run under cProfile on the loop thread alone
(thread CPU clock), its top functions by own time per step (cProfile's overhead inflates
them; compare within a run).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import math
import pstats
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import redis

from batchfleet.redis_server import LocalRedis

from .delta_path import OPTIONS

MODEL = "tiny"
REPLY = "bench:loop-cpu"
PARTS: list[tuple[str, str, str]] = [
    # (label, attribute path on the loop, method); indented: a share of the part above
    ("plan: next_step (scheduler, dispatch)", "stepper", "next_step"),
    ("  of it: scheduler.decide (the policy's plan)", "scheduler", "decide"),
    ("  of it: generating.dispatching (deltas expected)", "generating", "dispatching"),
    ("step done: stepper.finished", "stepper", "finished"),
    ("  of it: scheduler.finished", "scheduler", "finished"),
    ("  of it: generating._timing", "generating", "_timing"),
    ("  of it: generating._state (Generated)", "generating", "_state"),
    ("observers.notify (stats, metrics, events)", "observers", "notify"),
    ("sink.send", "parts.sink", "send"),
    ("sink.started", "parts.sink", "started"),
    ("admission.admit", "admission", "admit"),
    ("generating.watch (cancel watcher's list)", "generating", "watch"),
    ("loop._grant (intake budget)", "", "_grant"),
    ("holding feed update", "_feed", "update"),
]
"""The parts timed, as attributes of the running ``BatchLoop``."""


class Parts:
    """Thread CPU seconds and calls per part, on the loop thread. A top-level part (its
    label not indented) excludes the top-level parts it calls (a step's end plans the
    next step: that is planning's), so they add up; an indented one is a share of the
    top-level part above it, inclusive."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._open: list[str] = []
        """The top-level parts running now, innermost last."""

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time
        top = not label.startswith(" ")
        open_ = self._open

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            if top:
                open_.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0
                self.cpu[label] += spent
                self.calls[label] += 1
                if top:
                    open_.pop()
                    if open_:
                        self.cpu[open_[-1]] -= spent

        return wrapped


def _resolve(obj: Any, path: str) -> Any:
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name)
    return obj


def instrument(loop: Any, parts: Parts) -> None:
    """Wrap each part's method on the loop's own objects (made at ``run``: the feed)."""
    for label, path, method in PARTS:
        obj = _resolve(loop, path)
        setattr(obj, method, parts.wrap(label, getattr(obj, method)))
    for obs in loop.observers.observers:  # each observer's share of observers.notify
        obs.notify = parts.wrap(f"  of it: {type(obs).__name__}", obs.notify)


class StubEvents:
    """Flower's event sender without Celery: events queued, as the real one queues them
    for its thread."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def enabled(self) -> bool:
        return True

    def put(self, type_: str, fields: Any) -> None:
        self.events.append((type_, dict(fields, timestamp=time.time())))


def build_loop(url: str, model_dir: Path, running: int) -> Any:
    from batchfleet.worker.control import RecentRate
    from batchfleet.worker.events import FlowerEvents
    from batchfleet.worker.loop import BatchLoop
    from batchfleet.worker.metrics import Metrics, PrometheusObserver
    from batchfleet.worker.runners.generation import TextGenerationRunner
    from batchfleet.worker.vllm_metrics import VllmMetrics, VllmObserver
    from prometheus_client import CollectorRegistry

    from batchfleet.config import EventsConfig, ModelConfig, WorkerConfig

    options = dict(OPTIONS, max_running=running)
    cfg = ModelConfig(runner="text-generation", path=str(model_dir), device="cpu",
                      max_tokens=1024, options=options)  # fmt: skip
    runner = TextGenerationRunner(model_dir, device="cpu", max_tokens=1024, options=options)
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.init_model(MODEL, cfg.lanes)
    observers = [RecentRate(), PrometheusObserver(metrics),
                 VllmObserver(VllmMetrics(registry), MODEL, True),
                 FlowerEvents(StubEvents(), MODEL, EventsConfig())]  # type: ignore[arg-type]  # fmt: skip
    client = redis.Redis.from_url(url)
    return BatchLoop(MODEL, cfg, runner, client, consumer="bench", burst=True,
                     worker=WorkerConfig(block_ms=20), observers=observers)  # fmt: skip


def submit(client: redis.Redis, tok: Any, n: int, max_new: int, prompt_tokens: int) -> None:
    from .load import WORDS

    words = " ".join(WORDS[i % len(WORDS)] for i in range(prompt_tokens))
    prompt = tok.decode(tok(words)["input_ids"][:prompt_tokens])
    pipe = client.pipeline(transaction=False)
    for k in range(n):
        body = {"v": 1, "model": MODEL, "id": f"r{k}", "inputs": [prompt], "stream": True,
                "max_new_tokens": max_new, "ignore_eos": True, "reply": REPLY}  # fmt: skip
        pipe.xadd(f"bf:{{{MODEL}}}:lane:{1 + k % 2}", {"msgpack": msgpack.packb(body)})
    pipe.execute()


def thread_cpu() -> dict[str, float]:
    """Every live thread's CPU seconds so far, by name (``pthread_getcpuclockid``)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.ident is None:
            continue
        with contextlib.suppress(OSError, ProcessLookupError):
            clock = time.pthread_getcpuclockid(t.ident)
            out[t.name] = out.get(t.name, 0.0) + time.clock_gettime(clock)
    return out


def saturated(url: str, model_dir: Path, args: argparse.Namespace) -> tuple[redis.Redis, Any]:
    """A Redis emptied, a loop built on it (one torch thread), its requests queued."""
    import torch

    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    client.flushall()
    loop = build_loop(url, model_dir, args.running)
    submit(client, loop.runner.tokenizer, args.requests, args.max_new, args.prompt_tokens)
    return client, loop


def run_once(url: str, model_dir: Path, args: argparse.Namespace, profile: bool) -> dict[str, Any]:
    """One loop served to the end (burst mode): its thread's CPU by part, and its steps."""
    client, loop = saturated(url, model_dir, args)
    parts = Parts()
    steps = [0]
    finished = loop.stepper.finished

    def counted(done: Any) -> None:
        steps[0] += 1
        finished(done)

    loop.stepper.finished = counted
    out: dict[str, Any] = {}
    serve = loop._serve

    def instrumented_serve() -> None:  # the feed exists once run() began
        instrument(loop, parts)
        prof = cProfile.Profile(time.thread_time) if profile else None
        out["threads0"] = thread_cpu()
        t0 = time.thread_time()
        if prof is not None:
            prof.enable()
        try:
            serve()
        finally:
            if prof is not None:
                prof.disable()
            out["cpu"] = time.thread_time() - t0
            out["threads1"] = thread_cpu()
            out["profile"] = prof

    loop._serve = instrumented_serve
    wall = time.perf_counter()
    thread = threading.Thread(target=loop.run, name=f"batchloop-{MODEL}")
    thread.start()
    thread.join()
    out["wall"] = time.perf_counter() - wall
    out["steps"] = steps[0]
    out["parts"] = parts
    done = sum(1 for _ in client.scan_iter(f"bf:{{{MODEL}}}:result:*"))
    out["results"] = done
    client.close()
    return out


def per_step(res: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """µs and calls per step by part, in report order (``other`` and the total last)."""
    steps = max(res["steps"], 1)
    parts: Parts = res["parts"]
    labels = [label for label, _, _ in PARTS]
    at = labels.index("sink.send")  # each observer's share after observers.notify's
    labels[at:at] = [label for label in parts.cpu if label not in labels]
    out = {label: (parts.cpu.get(label, 0.0) / steps * 1e6, parts.calls.get(label, 0) / steps)
           for label in labels}  # fmt: skip
    top = sum(s for label, s in parts.cpu.items() if not label.startswith(" "))
    out["other (inbox, the loop's own code)"] = ((res["cpu"] - top) / steps * 1e6, math.nan)
    out["**the loop thread, all**"] = (res["cpu"] / steps * 1e6, math.nan)
    return out


def table(rows: dict[str, tuple[float, float]]) -> list[str]:
    lines = ["| part | µs per step | calls per step |", "| --- | --- | --- |"]
    for label, (us, calls) in rows.items():
        lines.append(f"| {label} | {us:.0f} | {'' if math.isnan(calls) else f'{calls:.2f}'} |")
    return lines


def report(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    steps = max(res["steps"], 1)
    return [
        f"{args.requests} streaming requests x {args.max_new} tokens, max_running "
        f"{args.running}: {res['results']} results, {res['steps']} steps in "
        f"{res['wall']:.1f} s; the loop thread's "
        f"CPU {res['cpu']:.3f} s = **{res['cpu'] / steps * 1e6:.0f} µs a step**",
        "",
        *table(per_step(res)),
        "",
        *threads_table(res),
    ]


def threads_table(res: dict[str, Any]) -> list[str]:
    """Each thread's CPU per step while the loop served (the device thread's is the
    engine's; the others share the rest of the host and the GIL)."""
    steps = max(res["steps"], 1)
    before, after = res["threads0"], res["threads1"]
    lines = ["| thread | µs per step |", "| --- | --- |"]
    for name, cpu in sorted(after.items()):
        lines.append(f"| {name} | {(cpu - before.get(name, 0.0)) / steps * 1e6:.0f} |")
    return lines


def profile_lines(res: dict[str, Any], top: int) -> list[str]:
    buf = io.StringIO()
    stats = pstats.Stats(res["profile"], stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    steps = max(res["steps"], 1)
    return ["", f"cProfile of the loop thread ({steps} steps; seconds are totals):", "",
            *buf.getvalue().splitlines()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loop_cpu", description=__doc__)
    p.add_argument("--requests", type=int, default=192, help="streaming requests (default 192)")
    p.add_argument("--running", type=int, default=64, help="the runner's max_running (64)")
    p.add_argument("--max-new", type=int, default=48, help="tokens a request (48)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="runs, each reported, then medians")
    p.add_argument("--profile", action="store_true", help="one more run under cProfile")
    p.add_argument("--top", type=int, default=30, help="cProfile's functions shown")
    args = p.parse_args(argv)
    from .generation import tiny_llama

    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        model_dir = tiny_llama(Path(tmp))
        runs = []
        for _ in range(args.rounds):
            runs.append(run_once(url, model_dir, args, False))
            print("\n".join(report(runs[-1], args)), flush=True)
            print()
        if len(runs) > 1:
            tables = [per_step(r) for r in runs]
            medians = {label: (statistics.median(t[label][0] for t in tables), calls)
                       for label, (_, calls) in tables[0].items()}  # fmt: skip
            print(f"Medians of {len(runs)} runs:\n")
            print("\n".join(table(medians)), flush=True)
            print()
        if args.profile:
            res = run_once(url, model_dir, args, True)
            print("\n".join(report(res, args) + profile_lines(res, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
