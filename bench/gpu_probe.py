"""``python -m bench.gpu_probe``: where a generation step's time goes on a device.

For a lent GPU (``bench/gpu_check.sh`` runs it; it runs on the CPU too). Per model (the
benchmark's random 4-layer Llama, and SmolLM2's shape with random weights):

- the device's launch cost: a small kernel enqueued back to back, and one waited for;
- HF ``generate``, one request and a padded batch: milliseconds per step;
- each engine (``padded``, with its lean step forward and with transformers' forwards;
  ``paged``) through the runner with ``rows`` sequences running:
  milliseconds per decode step, then one step profiled (``torch.profiler``): operators
  and kernels launched, the busiest operators by host time, and device-kernel time
  against the step's wall time.

Prints a markdown report (``--out``: also written there).
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .generation import smol_shape, tiny_llama


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def launch_costs(device: torch.device) -> list[str]:
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    enqueue = (time.perf_counter() - t0) / 2000
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(300):
        x.add_(1)
        _sync(device)
    waited = (time.perf_counter() - t0) / 300
    t0 = time.perf_counter()
    for _ in range(300):
        x.add_(1).item()
    item = (time.perf_counter() - t0) / 300
    return [
        f"- one small kernel enqueued back to back: {enqueue * 1e6:.1f} µs each",
        f"- one kernel and a synchronize: {waited * 1e6:.1f} µs; with `.item()`: {item * 1e6:.1f} µs",
    ]


def _generate_ms(model: Any, rows: int, prompt: int, new: int) -> float:
    ids = torch.randint(5, 200, (rows, prompt), device=model.device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, pad_token_id=0)  # fmt: skip
        _sync(model.device)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)  # fmt: skip
        _sync(model.device)
    return (time.perf_counter() - t0) * 1e3 / new


VIEWS = frozenset(f"aten::{name}" for name in (
    "view", "reshape", "_reshape_alias", "transpose", "t", "permute", "slice", "select",
    "unsqueeze", "squeeze", "expand", "as_strided", "narrow", "split", "chunk", "alias",
    "detach", "unbind", "view_as", "lift_fresh", "_unsafe_view",
))  # fmt: skip
"""Operators that only make a view (no kernel on a GPU): host time, but no launch."""


def engine_steps(runner: Any, rows: int, steps: int, top: int) -> tuple[float, list[str]]:
    """Milliseconds per decode step with ``rows`` running, and one step's profile."""
    from batchfleet.worker.generation.sampling import Sampling

    rng = random.Random(3)
    eng = runner.engine
    eng.reset()
    for i in range(rows):
        eng.add(f"p{i}", [rng.randrange(5, 200) for _ in range(rng.randint(16, 64))], 10_000,
                Sampling())  # fmt: skip
    for _ in range(8):  # every prefill done (64 tokens x rows within the step budget)
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if runner.torch_device.type == "cuda" else []
    )
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        eng.step()
        wall = (time.perf_counter() - t0) * 1e3
    events = list(prof.events())
    top_ops = collections.Counter[str]()
    host = collections.Counter[str]()
    kernels = 0
    kernel_us = 0.0
    for e in events:
        if e.device_type.name == "CUDA":
            kernels += 1
            kernel_us += e.device_time
            continue
        if e.name.startswith("aten::") and (
            e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
        ):
            top_ops[e.name] += 1
            host[e.name] += e.cpu_time_total
    eng.reset()
    lines = [
        f"  - profiled step: {wall:.1f} ms wall; {sum(top_ops.values())} top-level operators "
        f"({sum(n for k, n in top_ops.items() if k not in VIEWS)} not views); "
        f"{kernels} device kernels, {kernel_us / 1e3:.2f} ms of kernel time",
        "  - busiest operators (host ms incl. children / count): "
        + ", ".join(f"{k} {host[k] / 1e3:.2f}/{top_ops[k]}" for k, _ in host.most_common(top)),
    ]
    return statistics.median(times), lines


def probe(which: str, device: str, dtype: str, rows: int, workdir: Path,
          shape_from: Path | None) -> list[str]:  # fmt: skip
    from batchfleet.worker.runners.generation import TextGenerationRunner

    path = tiny_llama(workdir) if which == "tiny" else smol_shape(workdir, shape_from)
    out = [f"### {which}", ""]
    runners = {}
    variants = [("padded", {}), ("padded, transformers' forwards", {"engine": "padded",
                "lean_decode": False}), ("paged", {})]  # fmt: skip
    if device != "cpu":
        variants.append(("paged, CUDA graphs", {"engine": "paged", "cuda_graphs": True}))
    for kind, extra in variants:
        options = {"engine": kind, "kv_cache_tokens": 32768, "page_size": 32,
                   "step_tokens": 4096, "max_running": 64, **extra}  # fmt: skip
        try:
            runners[kind] = TextGenerationRunner(path, device=device, dtype=dtype,
                                                 max_tokens=1024, options=options)  # fmt: skip
        except Exception as exc:
            out.append(f"- engine `{kind}`: not built: {type(exc).__name__}: {str(exc)[:300]}")
    model = runners["padded"].model
    out.append(f"- dtype {model.dtype}, device {model.device}")
    one = _generate_ms(model, 1, 32, 48)
    batch = _generate_ms(model, rows, 32, 48)
    out.append(f"- HF generate: {one:.2f} ms/step at 1 row ({1e3 / one:.0f} tokens/s); "
               f"{batch:.2f} ms/step at {rows} rows ({rows * 1e3 / batch:.0f} tokens/s)")  # fmt: skip
    for kind, runner in runners.items():
        try:
            ms, lines = engine_steps(runner, rows, 24, 8)
        except Exception as exc:  # a variant this machine cannot run: say so, go on
            out.append(f"- engine `{kind}`: failed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        out.append(f"- engine `{kind}`: {ms:.2f} ms/decode step at {rows} rows "
                   f"({rows * 1e3 / ms:.0f} tokens/s; {one * rows / ms:.1f}x one-row generate)")  # fmt: skip
        out += lines
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_probe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", default=["tiny", "smol-shape"])
    p.add_argument("--dtype", default="auto", help="the runner's dtype (auto: bf16 on CUDA)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--smol-shape-from", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    lines = ["## Generation step probe", "", f"device: {device}"
             + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""),
             f"torch {torch.__version__}", ""]  # fmt: skip
    lines += [*launch_costs(device), ""]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for which in args.models:
            part = probe(which, args.device, args.dtype, args.rows, Path(tmp),
                         args.smol_shape_from)  # fmt: skip
            print("\n".join(part), flush=True)
            lines += part
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
