"""``python -m bench.decode_kernel``: the CPU decode attention kernel against the one
before it (457f3c0), interleaved in one process, on the generation benchmark's shapes.

``kernel`` (the default): the tiny Llama's attention (2 key-value heads of 64, 2 query
heads each) over ``--rows`` rows of mixed lengths (uniform 8 to ``--longest``; the
benchmark's saturated trace holds ~30 rows, ~10,000 keys), one buffer per layer as the
engine's cache (so a layer's keys are as cold as they are in a step), float32 and
bfloat16 keys and values, serial and on ``--parts`` threads. Prints nanoseconds per key
per key-value head (serial: this thread's CPU time, robust to a shared machine's other
processes; parallel: wall time), medians over ``--reps``, and old / new.

``engine``: the padded engine alone on the generation benchmark's trace (tiny Llama, one
torch thread, ``--matmul-precision medium --kv-cache-dtype bfloat16`` as issue #13's
runs), the old and the new kernel in turn: output tokens/s and CPU ms per output token.

    python -m bench.decode_kernel [kernel|engine] [--reps 15] [--rounds 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np


def old_kernels() -> tuple[Any, Any]:
    """The kernel as it was at 457f3c0, serial and parallel (same arguments as today's):
    one key at a time, a horizontal sum per key and query head, ``np.exp`` per score,
    bfloat16 rows widened through a scratch array."""
    import numba

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=False)
    def softmax(s: Any, n: int, top: Any, total: Any, acc: Any) -> None:
        """Each group's scores ``s[g, :n]`` into ``exp(score - top[g])``, their sum into
        ``total[g]``; ``acc`` zeroed."""
        group, dim = acc.shape
        for g in range(group):
            t = np.float32(0.0)
            for j in range(n):
                e = np.exp(s[g, j] - top[g])
                s[g, j] = e
                t += e
            total[g] = t
            for d in range(dim):
                acc[g, d] = 0.0

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=False)
    def finish(acc: Any, total: Any, out: Any) -> None:
        """``out[g] = acc[g] / total[g]``."""
        group, dim = acc.shape
        for g in range(group):
            inv = np.float32(1.0) / total[g]
            for d in range(dim):
                out[g, d] = acc[g, d] * inv

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=False)
    def one(q: Any, k: Any, v: Any, n: int, scale: float, out: Any, s: Any, acc: Any,
            top: Any, total: Any) -> None:  # fmt: skip
        """One row-head: ``out[g] = softmax(q[g] . k[:n] * scale) @ v[:n]`` (q, out:
        ``group x dim``; k, v: ``keys x dim``; scratch: s, acc, top, total)."""
        group, dim = q.shape
        top[:] = -np.inf
        for j in range(n):
            for g in range(group):
                x = np.float32(0.0)
                for d in range(dim):
                    x += q[g, d] * k[j, d]
                x *= scale
                s[g, j] = x
                if x > top[g]:
                    top[g] = x
        softmax(s, n, top, total, acc)
        for j in range(n):
            for g in range(group):
                p = s[g, j]
                for d in range(dim):
                    acc[g, d] += p * v[j, d]
        finish(acc, total, out)

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=False)
    def one16(q: Any, k: Any, v: Any, n: int, scale: float, out: Any, s: Any, acc: Any,
              top: Any, total: Any, bits: Any) -> None:  # fmt: skip
        """:func:`one` over bfloat16 keys and values (``uint16`` bit patterns), each row
        widened to float32 in ``bits`` (``uint32``, ``dim``) as it is read: a bfloat16 is
        a float32's upper half."""
        group, dim = q.shape
        wide = bits.view(np.float32)
        top[:] = -np.inf
        for j in range(n):
            for d in range(dim):
                bits[d] = np.uint32(k[j, d]) << 16
            for g in range(group):
                x = np.float32(0.0)
                for d in range(dim):
                    x += q[g, d] * wide[d]
                x *= scale
                s[g, j] = x
                if x > top[g]:
                    top[g] = x
        softmax(s, n, top, total, acc)
        for j in range(n):
            for d in range(dim):
                bits[d] = np.uint32(v[j, d]) << 16
            for g in range(group):
                p = s[g, j]
                for d in range(dim):
                    acc[g, d] += p * wide[d]
        finish(acc, total, out)

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=False)
    def pair(q: Any, k: Any, v: Any, n: int, r: int, h: int, scale: float, out: Any,
             s: Any, acc: Any, top: Any, total: Any, bits: Any) -> None:  # fmt: skip
        """Row ``r``, key-value head ``h``, over its first ``n`` keys: float32 keys and
        values, or bfloat16 ones (``uint16``: half the bytes to read)."""
        if k.itemsize == 2:
            one16(q[r, h], k[r, h], v[r, h], n, scale, out[r, h], s, acc, top, total, bits)
        else:
            one(q[r, h], k[r, h], v[r, h], n, scale, out[r, h], s, acc, top, total)

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=False)
    def attend(q: Any, k: Any, v: Any, lengths: Any, scale: float, out: Any) -> None:
        """``out[r, h, g] = softmax(q[r, h, g] . k[r, h, :n] * scale) @ v[r, h, :n]`` with
        ``n = lengths[r]``; q, out: ``rows x kv_heads x group x dim``; k, v: ``rows x
        kv_heads x width x dim``, float32 or bfloat16 seen as ``uint16``."""
        rows, heads, group, dim = q.shape
        s = np.empty((group, k.shape[2]), np.float32)
        acc = np.empty((group, dim), np.float32)
        top = np.empty(group, np.float32)
        total = np.empty(group, np.float32)
        bits = np.empty(dim, np.uint32)
        for r in range(rows):
            for h in range(heads):
                pair(q, k, v, lengths[r], r, h, scale, out, s, acc, top, total, bits)

    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=False, parallel=True)
    def attend_parallel(
        q: Any, k: Any, v: Any, lengths: Any, scale: float, out: Any, parts: int
    ) -> None:
        """:func:`attend` on ``parts`` threads: part ``t`` takes row-heads ``t``, ``t +
        parts``, ... (round-robin, so long and short rows spread evenly)."""
        rows, heads, group, dim = q.shape
        for t in numba.prange(parts):
            s = np.empty((group, k.shape[2]), np.float32)
            acc = np.empty((group, dim), np.float32)
            top = np.empty(group, np.float32)
            total = np.empty(group, np.float32)
            bits = np.empty(dim, np.uint32)
            for i in range(t, rows * heads, parts):
                r = i // heads
                pair(q, k, v, lengths[r], r, i - r * heads, scale, out, s, acc, top, total, bits)

    return attend, attend_parallel


def shapes(rows: int, longest: int, layers: int, seed: int) -> dict[str, Any]:
    """Queries, per-layer key and value buffers (float32 and their bfloat16 bits) and row
    lengths like a saturated decode step's."""
    import torch

    rng = np.random.default_rng(seed)
    heads, group, dim = 2, 2, 64
    lengths = rng.integers(8, longest + 1, rows).astype(np.int64)
    q = rng.standard_normal((rows, heads, group, dim)).astype(np.float32)
    width = int(lengths.max())

    def buffers() -> list[Any]:
        return [rng.standard_normal((rows, heads, width, dim)).astype(np.float32)
                for _ in range(layers)]  # fmt: skip

    k32, v32 = buffers(), buffers()

    def bits(a: Any) -> Any:
        return torch.from_numpy(a).to(torch.bfloat16).view(torch.uint16).numpy()

    return {"q": q, "lengths": lengths, "float32": (k32, v32),
            "bfloat16": ([bits(a) for a in k32], [bits(a) for a in v32])}  # fmt: skip


def step(kernels: tuple[Any, Any], q: Any, ks: list[Any], vs: list[Any], lengths: Any,
         scale: Any, parts: int) -> Any:  # fmt: skip
    """One decode step's attention, every layer: the serial kernel, or the parallel one on
    ``parts`` threads."""
    serial, parallel = kernels
    out = np.empty_like(q)
    for k, v in zip(ks, vs, strict=True):
        if parts == 1:
            serial(q, k, v, lengths, scale, out)
        else:
            parallel(q, k, v, lengths, scale, out, parts)
    return out


def kernel_bench(args: argparse.Namespace) -> None:
    """Old and new kernel, interleaved, per KV dtype and serial / parallel."""
    from batchfleet.worker.generation import decode_attention

    if decode_attention.kernel() is None or decode_attention._parallel is None:
        raise SystemExit("numba cannot compile the kernel here")
    arms = {"old": old_kernels(), "new": (decode_attention._kernel, decode_attention._parallel)}
    data = shapes(args.rows, args.longest, args.layers, args.seed)
    q, lengths = data["q"], data["lengths"]
    keys = int(lengths.sum()) * q.shape[1] * args.layers
    scale = np.float32(0.125)
    print(f"{args.rows} rows, {int(lengths.sum()):,} keys, lengths 8-{args.longest}, "
          f"{args.layers} layers, 2 KV heads x group 2 x dim 64; ns per key per KV head, "
          f"median of {args.reps}")  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        ks, vs = data[dtype]
        for parts in (1, args.parts):
            got = {
                arm: step(arms[arm], q, ks, vs, lengths, scale, parts) for arm in arms
            }  # compiled, warm
            diff = float(np.abs(got["old"] - got["new"]).max())
            clock = time.thread_time if parts == 1 else time.perf_counter
            ns: dict[str, list[float]] = {arm: [] for arm in arms}
            for _ in range(args.reps):
                for arm in arms:  # interleaved: A/B/A/B
                    t = clock()
                    step(arms[arm], q, ks, vs, lengths, scale, parts)
                    ns[arm].append((clock() - t) / keys * 1e9)
            med = {arm: statistics.median(v) for arm, v in ns.items()}
            print(f"{dtype:8s} parts={parts}: old {med['old']:6.2f}  new {med['new']:6.2f}  "
                  f"old/new {med['old'] / med['new']:.2f}  (max |old - new| {diff:.1e})",
                  flush=True)  # fmt: skip


@contextlib.contextmanager
def old_kernel() -> Iterator[None]:
    """The engine's decode attention on the old kernel."""
    from batchfleet.worker.generation import decode_attention

    decode_attention.kernel()
    saved = decode_attention._kernel, decode_attention._parallel
    decode_attention._kernel, decode_attention._parallel = old_kernels()
    try:
        yield
    finally:
        decode_attention._kernel, decode_attention._parallel = saved


ARMS: dict[str, Callable[[], Any]] = {"old": old_kernel, "new": contextlib.nullcontext}


def engine_bench(args: argparse.Namespace) -> None:
    """The engine alone on the benchmark's trace, old and new kernel in turn."""
    from . import generation as g

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    options = {"engine": "padded", "kv_cache_tokens": 32768, "page_size": 32,
               "step_tokens": 512, "max_running": 64, "matmul_precision": "medium",
               "kv_cache_dtype": args.kv_cache_dtype}  # fmt: skip
    if args.kv_cache_dtype == "auto":
        del options["kv_cache_dtype"]
    with tempfile.TemporaryDirectory() as tmp:
        _, runner, jobs = g.engine_bench_trace("tiny", options, Path(tmp), args.requests,
                                               args.seed)  # fmt: skip
        for arm in ARMS:  # each kernel compiled and its buffers grown before timing
            with ARMS[arm]():
                g.engine_alone(runner, jobs[:8], 0.0, "warm-up")
        rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
        cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for k in range(args.rounds):
            for arm in ARMS if k % 2 == 0 else reversed(ARMS):  # A/B, B/A, ...
                runner.engine.reset()
                before = resource.getrusage(resource.RUSAGE_SELF)
                with ARMS[arm]():
                    out = g.engine_alone(runner, jobs, args.rate, arm)
                after = resource.getrusage(resource.RUSAGE_SELF)
                tokens = sum(out.tokens)
                ms = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                rates[arm].append(out.tokens_per_s)
                cpu[arm].append(ms * 1e3 / tokens)
                print(f"round {k + 1} {arm}: {out.tokens_per_s:7.1f} tokens/s, "
                      f"{cpu[arm][-1]:.3f} CPU ms per output token ({tokens:,} tokens)",
                      flush=True)  # fmt: skip
        for arm in ARMS:
            print(
                f"median {arm}: {statistics.median(rates[arm]):7.1f} tokens/s, "
                f"{statistics.median(cpu[arm]):.3f} CPU ms per output token"
            )
        print(
            f"new / old tokens/s: "
            f"{statistics.median(rates['new']) / statistics.median(rates['old']):.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_kernel",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("what", nargs="?", choices=["kernel", "engine"], default="kernel")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--longest", type=int, default=640, help="rows are 8 to this many keys")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--parts", type=int, default=2, help="threads of the parallel kernel")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--requests", type=int, default=96, help="engine: the trace's requests")
    p.add_argument("--rate", type=float, default=66.0, help="engine: arrivals per second")
    p.add_argument("--rounds", type=int, default=4, help="engine: runs of each kernel")
    p.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16"], default="bfloat16")
    args = p.parse_args(argv)
    (engine_bench if args.what == "engine" else kernel_bench)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
