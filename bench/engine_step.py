"""Where the padded engine's step spends its time, by part, on the generation benchmark's trace.

``python -m bench.engine_step [--matmul-precision medium] [--kv-cache-dtype bfloat16]``

The runner and scheduler of ``python -m bench.generation``'s "engine alone" run (tiny
Llama, one torch thread, the same seeded trace at 4x the capacity a burst measures), with
the engine's parts wrapped in timers: the linear layers (:func:`.precision.linear`, the LM
head), the decode attention kernel, the prefill attention (sdpa), the KV writes (slot and
slab layers), embedding, norms, rotary, the argmax / sampling, the batch's joins, leaves
and decode preparation. What the engine's step spends outside them is Python glue and
the small tensor operators between them; the runner's part is what ``runner.step`` spends
outside ``engine.step`` (detokenizing, events). Prints CPU ms (this thread's: a shared
machine's waits left out) per step and per output token. The timers cost about a
microsecond a call, so the parts' sum reads a little high; ``--no-parts`` times the whole
step alone (for a before/after comparison).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .generation import engine_alone, engine_bench_trace

_clock = time.thread_time
"""CPU time of this thread: on a shared machine, what the step costs, not what it waited."""


class Parts:
    """Seconds and calls per part; nested timers count only in the innermost part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed as ``part`` (its nested parts' time taken out of it)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [0.0]
            self._stack.append(frame)
            t = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = _clock() - t
                self._stack.pop()
                self.seconds[part] += spent - frame[0]
                self.calls[part] += 1
                if self._stack:
                    self._stack[-1][0] += spent

        return timed


def instrument(parts: Parts, runner: Any) -> None:
    """Wrap the engine's parts (module docstring) in ``parts``' timers."""
    from batchfleet.worker.generation import (
        decode_attention,
        lean_decode,
        padded_batch,
        padded_cache,
        padded_state,
    )

    engine = runner.engine
    lean = engine.lean
    assert lean is not None, "the engine has no lean forward"
    lean_decode.linear = parts.wrap("linears", lean_decode.linear)
    decode_attention.attention = parts.wrap("decode attention", decode_attention.attention)
    decode_attention.attend_rows = parts.wrap("decode attention", decode_attention.attend_rows)
    decode_attention.attend_arrays = parts.wrap("decode attention",
                                                decode_attention.attend_arrays)  # fmt: skip
    decode_attention.sdpa = parts.wrap("prefill attention (sdpa)", decode_attention.sdpa)
    for cls, name in ((padded_cache.SlotLayer, "KV write: decode rows"),
                      (padded_cache.SlabLayer, "KV write: prefill slabs")):  # fmt: skip
        cls.update = parts.wrap(name, cls.update)
    padded_cache.SlotLayer.place = parts.wrap("join/leave rows", padded_cache.SlotLayer.place)
    padded_cache.SlotLayer.move = parts.wrap("join/leave rows", padded_cache.SlotLayer.move)
    padded_batch._Batch._prepare_decode = parts.wrap(
        "prepare decode", padded_batch._Batch._prepare_decode
    )
    padded_state._State._pick = parts.wrap("sampling (argmax)", padded_state._State._pick)
    head = lean.head
    head.forward = parts.wrap("linears", head.forward)
    lean.embed.forward = parts.wrap("embedding", lean.embed.forward)
    lean.rotary.forward = parts.wrap("rotary cos/sin", lean.rotary.forward)
    norms = [lean.norm] + [n for la in lean.layers for n in (la.input_norm, la.post_norm)]
    for norm in norms:
        norm.forward = parts.wrap("norms", norm.forward)
    for layer in lean.layers:
        layer.act.forward = parts.wrap("activation", layer.act.forward)
    if lean.rotate_half is not None:
        lean.rotate_half = parts.wrap("rotary apply", lean.rotate_half)
    engine.step = parts.wrap("engine glue (Python, small ops)", engine.step)
    runner.step = parts.wrap("runner outside the engine", runner.step)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_step",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("--matmul-precision", choices=["highest", "medium"], default="medium")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16"], default="bfloat16")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--saturation", type=float, default=4.0)
    p.add_argument("--no-parts", action="store_true", help="no timers: the step's time alone")
    p.add_argument("--ops", type=int, default=0, help="also torch.profiler's top N operators")
    p.add_argument("--functions", type=int, default=0, help="also cProfile's top N by own time")
    args = p.parse_args(argv)
    options: dict[str, Any] = {"engine": "padded", "kv_cache_tokens": 32768, "page_size": 32,
                               "step_tokens": 512, "max_running": 64}  # fmt: skip
    if args.matmul_precision != "highest":
        options["matmul_precision"] = args.matmul_precision
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    with tempfile.TemporaryDirectory() as tmp:
        _, runner, jobs = engine_bench_trace("tiny", options, Path(tmp), args.requests, args.seed)
    engine_alone(runner, jobs[:2], 0.0, "warm-up")
    burst = engine_alone(runner, jobs[:24], 0.0, "calibration")
    rate = args.saturation * burst.completed / burst.span
    parts = Parts()
    if args.no_parts:
        runner.step = parts.wrap("runner step", runner.step)
    else:
        instrument(parts, runner)
    t = _clock()
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = engine_alone(runner, jobs, rate)
    elif args.functions:
        functions = cProfile.Profile()
        with functions:
            out = engine_alone(runner, jobs, rate)
    else:
        out = engine_alone(runner, jobs, rate)
    cpu = _clock() - t
    tokens, steps = out.total_tokens, out.steps
    wall_s = sum(out.extra["step ms"]) / 1e3
    print(
        f"{steps} steps, {tokens} output tokens, {out.tokens_per_s:,.1f} tokens/s "
        f"(span {out.span:.2f} s; steps' wall time {wall_s:.3f} s; run's CPU {cpu:.2f} s)"
    )
    step_s = sum(parts.seconds.values())
    print(
        f"steps' CPU {step_s:.3f} s = {step_s / steps * 1e3:.2f} ms a step, "
        f"{step_s / tokens * 1e3:.3f} ms a token"
    )
    if args.functions:
        pstats.Stats(functions).sort_stats("tottime").print_stats(args.functions)
    if args.no_parts:
        return
    print(
        "| part | ms a step | ms a token | share | calls a step |\n| --- | --- | --- | --- | --- |"
    )
    for part, s in sorted(parts.seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {s / steps * 1e3:.2f} | {s / tokens * 1e3:.4f} | "
              f"{s / step_s:.0%} | {parts.calls[part] / steps:.1f} |")  # fmt: skip
    if args.ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))


if __name__ == "__main__":
    main()
