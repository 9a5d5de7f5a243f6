"""``python -m bench.prefix_cache``: the padded engine with a prefix cache against none,
engine alone, alternating in one process, on requests that share a system prompt
(``--engine paged``: the paged engine with its block sharing on and off, on a Llama: a
model whose every layer attends to the whole context, the only ones it shares for).

Each request is a long system prompt (``--system`` tokens, the same for all) followed
by its own question (8-64 tokens) and asks for 8-64 new tokens; arrivals are Poisson at
``--rate`` (saturating). The arms differ only in ``options.prefix_cache_tokens``: ``off``
(0, the default) and ``on`` (a cache that starts empty each round, so the first request
fills it). With ``--mixed``, the generation benchmark's mixed trace (nothing shared: what the
cache costs where it finds nothing). Prints tokens/s, time to first token (mean and p90), and the prompt tokens the
model ran and those the cache gave, per arm and round; one torch thread.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from pathlib import Path

from . import generation as g


def jobs_sharing(tok: object, n: int, system_tokens: int, seed: int) -> list[g.Job]:
    """``n`` requests: the same system prompt, then each one's question."""
    rng = random.Random(seed)
    tokenize = tok  # type: ignore[assignment]

    def text_of(words: int) -> str:
        return " ".join(rng.choices(g.WORDS, k=words))

    system = text_of(system_tokens)
    while len(tokenize(system)["input_ids"]) > system_tokens:  # type: ignore[operator]
        system = system.rsplit(" ", 1)[0]
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1.0)
        text = f"{system} {text_of(rng.randint(8, 64))}"
        ids = tuple(tokenize(text)["input_ids"])  # type: ignore[operator]
        out.append(g.Job(i, t, rng.choice((0, 1, 2)), text, ids, rng.randint(8, 64)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.prefix_cache", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--system", type=int, default=400, help="system prompt tokens")
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--prefix-cache-tokens", type=int, default=4096)
    p.add_argument("--engine", choices=["padded", "paged"], default="padded")
    p.add_argument("--mixed", action="store_true",
                   help="the generation benchmark's mixed trace instead (nothing shared: "
                        "what the cache costs)")  # fmt: skip
    p.add_argument(
        "--arms",
        nargs="+",
        choices=["off", "on"],
        default=["off", "on"],
        help="the arms of each round, in order",
    )
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from batchfleet.worker.generation.prefix_cache import PrefixCache

    options = {"engine": args.engine, "kv_cache_tokens": 32768, "page_size": 32,
               "step_tokens": 512, "max_running": 64, "prefix_cache_tokens": 0}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model, runner = g.engine_bench_runner(args.model, options, Path(tmp))
        tok = runner.tokenizer
        if args.mixed:
            jobs = g.workload(lambda s: list(tok(s)["input_ids"]), lambda ids: str(tok.decode(ids)),
                              args.requests, args.seed)  # fmt: skip
        else:
            jobs = jobs_sharing(tok, args.requests, args.system, args.seed)
        prompt = statistics.mean(len(j.prompt) for j in jobs)
        shared = "nothing shared" if args.mixed else f"{args.system}-token system prompt"
        print(f"{model.name}: {len(jobs)} requests at {args.rate}/s, prompts {prompt:.0f} tokens "
              f"on average ({shared}), one torch thread")  # fmt: skip
        engine = runner.engine
        paged = args.engine == "paged"
        g.engine_alone(runner, jobs[:2], 0.0, "warm-up")
        for k in range(args.rounds):
            for arm in args.arms:
                engine.reset()
                if paged:  # its cached blocks went with the reset
                    engine.processor.cache.use_prefix_sharing = arm == "on"
                    ran, hit0 = sum(len(j.prompt) for j in jobs), engine.sharing.hit_tokens
                else:
                    engine.prefix = (
                        PrefixCache(args.prefix_cache_tokens, 32) if arm == "on" else None
                    )
                    ran = engine.prefilled
                out = g.engine_alone(runner, jobs, args.rate, arm)
                ttft = sorted((f - s) * 1e3 for f, s in zip(out.first, out.start, strict=True)
                              if f is not None and s is not None)  # fmt: skip
                if paged:  # prompts' tokens (a preempted one's again not counted) less hits
                    hit = engine.sharing.hit_tokens - hit0
                    ran = ran - hit
                else:
                    hit = engine.prefix.hit_tokens if engine.prefix is not None else 0
                    ran = engine.prefilled - ran
                print(f"round {k + 1} {arm:3s} {out.tokens_per_s:7.1f} tokens/s, TTFT mean "
                      f"{statistics.mean(ttft):6.1f} ms, p90 {ttft[int(0.9 * len(ttft))]:6.1f} "
                      f"ms, prompt tokens run {ran:,}, from the cache {hit:,}",
                      flush=True)  # fmt: skip
        if not paged:
            engine.prefix = None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
