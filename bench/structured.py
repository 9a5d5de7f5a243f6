"""``python -m bench.structured``: what structured outputs cost, engine alone, alternating
free and constrained requests in one process.

The generation benchmark's mixed trace (prompts 8-512 tokens, 8-256 new tokens, Poisson
arrivals at ``--rate``, saturating) runs in arms that differ only in each request's
``structured_outputs``: ``free`` (none), ``json`` (a JSON Schema: an object with a name,
a number, a list of tags and a free text of up to 600 chars, compact) and ``regex``
(``[a-z ]+[.]``), and ``tools`` (the grammar ``strict`` functions hold a hermes
model's text to under ``tool_choice`` ``auto``: free text; ``--parser`` another format's). A JSON text ends when it is complete, so it generates fewer tokens
than a free one: the arm ``free@json`` is free requests each asking for the tokens its
``json`` twin generated in the round (the same work without the constraint). Compare
tokens/s, and the time the masks took per
constrained token (llguidance's masks, made a step's rows at a time, as boolean rows:
timed around ``SeededSampler._allowed``). One torch thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import generation as g

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "count": {"type": "integer", "minimum": 0, "maximum": 100000},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 8},
        "notes": {"type": "string", "maxLength": 600},
    },
    "required": ["name", "count", "tags", "notes"],
    "additionalProperties": False,
}
ARMS: dict[str, dict[str, Any] | None] = {
    "free": None,
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "regex": {"regex": "[a-z ]+[.]"},
    "tools": {},  # made for the runner's tokenizer (strict_calls.grammar)
}
TOOLS = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
          "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"]}, True),
         ("get_time", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}, True)]  # fmt: skip
"""The ``tools`` arm's functions: its requests are held as ``tool_choice`` ``auto`` with
``strict`` functions holds a hermes model's text (free text, and calls once
``<tool_call>`` is written), the grammar given as ``structured_outputs``: what a strict
tools request costs where the model writes text."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.structured",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--parser", default="hermes",
                   help="the tool_call_parser whose strict grammar the tools arm holds")  # fmt: skip
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=400.0, help="arrivals per second")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--arms", nargs="+", choices=[*ARMS, "free@json"],
                   default=[*ARMS, "free@json"],
                   help="the arms of each round, in order (free@json after json)")  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from batchfleet.worker.generation.sampling import SeededSampler

    spent = [0.0, 0]  # seconds in the masks, masks made
    allowed = SeededSampler._allowed

    def timed(self: SeededSampler, tracks: list[Any], logits: Any) -> Any:
        t = time.perf_counter()
        out = allowed(self, tracks, logits)
        spent[0] += time.perf_counter() - t
        spent[1] += len(tracks)
        return out

    SeededSampler._allowed = timed  # type: ignore[method-assign]
    options = {"engine": "padded", "kv_cache_tokens": 32768, "page_size": 32,
               "step_tokens": 512, "max_running": 64}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model, runner, jobs = g.engine_bench_trace(args.model, options, Path(tmp),
                                                   args.requests, args.seed)  # fmt: skip
        from batchfleet.worker.generation import strict_calls

        token = runner._grammars.token
        ARMS["tools"] = {"grammar": strict_calls.grammar(args.parser, TOOLS, True, token)}
        print(f"{model.name}: {len(jobs)} requests at {args.rate}/s (the mixed trace), "
              f"vocabulary {runner.vocab_size:,}, one torch thread")  # fmt: skip
        g.engine_alone(runner, jobs[:2], 0.0, "warm-up")
        g.engine_alone(runner, jobs[:2], 0.0, "warm-up", {"structured_outputs": ARMS["json"]})
        for k in range(args.rounds):
            lengths: list[int] = []
            for arm in args.arms:
                spec = ARMS.get(arm)
                trace = jobs
                if arm == "free@json":
                    if not lengths:
                        raise SystemExit("free@json needs the json arm before it")
                    trace = [
                        replace(j, max_new=max(1, n)) for j, n in zip(jobs, lengths, strict=True)
                    ]
                runner.engine.reset()
                spent[:] = [0.0, 0]
                out = g.engine_alone(runner, trace, args.rate, arm,
                                     None if spec is None else {"structured_outputs": spec})  # fmt: skip
                if arm == "json":
                    lengths = list(out.tokens)
                made = [t for t in out.tokens if t]
                stops = sum(f == "stop" for f in out.finish)
                per = f"{spent[0] / spent[1] * 1e3:.3f} ms" if spent[1] else "-"
                print(f"round {k + 1} {arm:9s} {out.tokens_per_s:8.1f} tokens/s, "
                      f"{statistics.mean(made):5.1f} tokens a request, {stops}/{len(jobs)} "
                      f"ended stop, masks {spent[1]:,} at {per} each "
                      f"({spent[0]:.2f} s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
