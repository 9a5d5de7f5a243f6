"""``python -m bench.kv_reserve``: the padded engine with its KV buffers reserved once
against grown by doubling, and bounded by the KV budget against not, engine alone,
alternating in one process.

The arms differ only in how a fresh engine's running-batch KV buffers come to be and
are kept (``worker/generation/reserve.py``): ``reserved`` (today: ``max_running`` rows of
the longest context, address space taken from the OS as rows write, pages past the
sequences handed back where the rows hold more than ``kv_cache_tokens``), ``unbounded``
(reserved, pages kept) and ``grown`` (before: ``torch.zeros`` buffers doubling in rows and
columns, each growth copied). Each run starts
from an empty engine (``reset``), as a fresh worker does, on the generation benchmark's
mixed trace (``bench/generation.py``: prompts 8-512, outputs 8-256 tokens, three lanes),
one torch thread. Prints tokens/s, the process's user and kernel CPU seconds, and for
reserved buffers the tokens the rows hold written at the end and the bytes released.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import generation as g


@contextlib.contextmanager
def grown(engine: Any) -> Iterator[None]:
    """The engine as it was before reservation: zeroed buffers grown by doubling."""
    from batchfleet.worker.generation import reserve

    zeros, context = reserve.zeros, engine.max_context
    reserve.zeros = lambda shape, like: like.new_zeros(shape)  # type: ignore[assignment]
    engine.max_context = None
    try:
        yield
    finally:
        reserve.zeros, engine.max_context = zeros, context  # type: ignore[assignment]


@contextlib.contextmanager
def unbounded(engine: Any) -> Iterator[None]:
    """Reserved buffers that keep every page written (before the KV budget bound them)."""
    bound = engine.resident_tokens
    engine.resident_tokens = None
    try:
        yield
    finally:
        engine.resident_tokens = bound


ARMS = {"grown": grown, "unbounded": unbounded, "reserved": lambda e: contextlib.nullcontext()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.kv_reserve", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second (saturating)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["grown", "reserved"])
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    options = {"engine": "padded", "kv_cache_tokens": args.kv_cache_tokens, "page_size": 32,
               "step_tokens": 512, "max_running": 64}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model, runner, jobs = g.engine_bench_trace(args.model, options, Path(tmp),
                                                   args.requests, args.seed)  # fmt: skip
        g.engine_alone(runner, jobs[:2], 0.0, "warm-up")
        print(f"{model.name}, {len(jobs)} requests at {args.rate}/s, longest context "
              f"{runner.engine.max_context}, max_running {runner.engine.max_running}")  # fmt: skip
        for k in range(args.rounds):
            for arm in args.arms:
                engine = runner.engine
                engine.reset()
                released = engine.released_bytes
                before = resource.getrusage(resource.RUSAGE_SELF)
                with ARMS[arm](engine):
                    out = g.engine_alone(runner, jobs, args.rate, arm)
                    held = engine.resident
                after = resource.getrusage(resource.RUSAGE_SELF)
                print(f"round {k + 1} {arm:9s} {out.tokens_per_s:7.1f} tokens/s, user "
                      f"{after.ru_utime - before.ru_utime:5.1f} s, kernel "
                      f"{after.ru_stime - before.ru_stime:5.1f} s, rows hold {held:,} tokens "
                      f"written, released {(engine.released_bytes - released) / 2**20:,.0f} "
                      "MiB", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
