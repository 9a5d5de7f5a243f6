"""``python -m bench.kv_reserve``: the padded engine with its KV buffers reserved once
against grown by doubling, engine alone, alternating in one process.

The arms differ only in how a fresh engine's running-batch KV buffers come to be
(``worker/generation/reserve.py``): ``reserved`` (today: ``max_running`` rows of the
longest context, address space taken from the OS as rows write) and ``grown`` (before:
``torch.zeros`` buffers doubling in rows and columns, each growth copied). Each run starts
from an empty engine (``reset``), as a fresh worker does, on the generation benchmark's
mixed trace (``bench/generation.py``: prompts 8-512, outputs 8-256 tokens, three lanes),
one torch thread. Prints tokens/s and the process's user and kernel CPU seconds per run.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.kv_reserve", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second (saturating)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=13)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from batchfleet.worker.device import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # as a generating worker does
    options = {"engine": "padded", "kv_cache_tokens": 32768, "page_size": 32,
               "step_tokens": 512, "max_running": 64}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model = g.GenModel("tiny-llama", g.tiny_llama(Path(tmp)), options)
        else:
            model = g.GenModel("smollm2", g.smollm2_dir(), {"gguf_file": g.SMOLLM2_GGUF, **options})
        runner = g.load_runner(model)
        tok = runner.tokenizer
        jobs = g.workload(lambda s: list(tok(s)["input_ids"]), lambda ids: str(tok.decode(ids)),
                          args.requests, args.seed)  # fmt: skip
        g.engine_alone(runner, jobs[:2], 0.0, "warm-up")
        print(f"{model.name}, {len(jobs)} requests at {args.rate}/s, longest context "
              f"{runner.engine.max_context}, max_running {runner.engine.max_running}")  # fmt: skip
        for k in range(args.rounds):
            for arm in ("grown", "reserved"):
                runner.engine.reset()
                before = resource.getrusage(resource.RUSAGE_SELF)
                with grown(runner.engine) if arm == "grown" else contextlib.nullcontext():
                    out = g.engine_alone(runner, jobs, args.rate, arm)
                after = resource.getrusage(resource.RUSAGE_SELF)
                print(f"round {k + 1} {arm:8s} {out.tokens_per_s:7.1f} tokens/s, user "
                      f"{after.ru_utime - before.ru_utime:5.1f} s, kernel "
                      f"{after.ru_stime - before.ru_stime:5.1f} s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
