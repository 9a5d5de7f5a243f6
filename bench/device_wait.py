"""``python -m bench.device_wait``: what a generating worker's device thread waits on
between and inside its steps, at saturation.

The loop of ``bench.loop_cpu`` (a real ``BatchLoop`` serving the tiny Llama from a real
Redis, the worker's observers) runs ``--requests`` streaming requests, more than
``--running``, so the engine stays full. Each step of the device thread is split into
parts (the engine's step; the runner's Python around it; the hand-off: deltas written,
progress settled, the loop told; the gap until the next step begins), each timed in wall
time and in the thread's own CPU (``time.thread_time``). For the whole step the kernel's
``/proc/thread-self/schedstat`` also gives the time the thread was runnable but not
running (the **run queue**: other processes, or this one's other threads, held the
cores); what is left of the wall time, neither running nor runnable, the thread was
**blocked**: waiting for the GIL, or for its next step to be queued. Linux only.

Alongside, every other thread of this process: its CPU per step (the loop, the sink, the
intake...), an upper bound on the GIL they can take from the device thread.
``--switch`` runs once per ``sys.setswitchinterval`` value given (seconds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from batchfleet.redis_server import LocalRedis

from .loop_cpu import saturated

PARTS = ("engine", "runner", "hand-off", "gap")


def schedstat() -> tuple[float, float]:
    """This thread's CPU and run-queue wait so far, in seconds (the kernel's counters)."""
    with open("/proc/thread-self/schedstat") as f:
        cpu, queued, _ = f.read().split()
    return int(cpu) / 1e9, int(queued) / 1e9


def threads_cpu() -> dict[int, float]:
    """CPU seconds so far of each thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


class Stamps:
    """Per step of the device thread: the wall and thread-CPU stamps at each part's
    bounds, and the kernel's counters at its start."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.cur: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        self.cur[name] = (time.perf_counter(), time.thread_time())


def instrument(loop: Any, st: Stamps) -> None:
    """Wrap the runner's step, its engine's step and the executor's hand-off."""
    runner, executor = loop.runner, loop.parts.device
    engine_step, runner_step, post = runner.engine.step, runner.step, executor._post

    def engine(*args: Any) -> Any:
        st.mark("e0")
        try:
            return engine_step(*args)
        finally:
            st.mark("e1")

    def step(work: Any) -> Any:
        st.cur = {"sched": schedstat()}
        st.mark("s0")
        try:
            return runner_step(work)
        finally:
            st.mark("s1")

    def hand_off(done: Any) -> None:
        st.mark("p0")
        try:
            post(done)
        finally:
            st.mark("p1")
            st.steps.append(st.cur)

    runner.engine.step, runner.step, executor._post = engine, step, hand_off


def split(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """One step (``a``; ``b``: the next) by part: (wall, thread CPU) seconds."""

    def span(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
        return y[0] - x[0], y[1] - x[1]

    engine = span(a["e0"], a["e1"]) if "e0" in a else (0.0, 0.0)
    whole = span(a["s0"], a["s1"])
    return {
        "engine": engine,
        "runner": (whole[0] - engine[0], whole[1] - engine[1]),
        "hand-off": span(a["s1"], a["p1"]),
        "gap": span(a["p1"], b["s0"]),
    }


def run_once(url: str, model_dir: Path, args: argparse.Namespace) -> list[str]:
    """One loop served to the end (burst mode): its device thread's steps, as lines."""
    client, loop = saturated(url, model_dir, args)
    st = Stamps()
    instrument(loop, st)
    before = threads_cpu()
    wall = time.perf_counter()
    thread = threading.Thread(target=loop.run, name="bench-loop")
    thread.start()
    last: dict[int, float] = before
    names: dict[int, str] = {}
    while True:  # the threads' counters while they live (they end with the loop)
        thread.join(0.25)
        if not thread.is_alive():
            break
        last = threads_cpu()
        names |= {t.native_id: t.name for t in threading.enumerate() if t.native_id}
    wall = time.perf_counter() - wall
    client.close()
    steps = st.steps
    n = len(steps) - 1
    rows = [split(a, b) for a, b in pairwise(steps)]
    lines = [f"switch interval {sys.getswitchinterval() * 1e3:g} ms: {n} steps in {wall:.1f} s "
             f"({args.requests * args.max_new / wall:.0f} tokens/s), load average "
             f"{os.getloadavg()[0]:.1f}", "",
             "| device thread, per step | wall ms (mean) | wall ms (p50) | own CPU ms (mean) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for part in PARTS:
        w = [r[part][0] * 1e3 for r in rows]
        c = [r[part][1] * 1e3 for r in rows]
        lines.append(f"| {part} | {statistics.mean(w):.2f} | {statistics.median(w):.2f} | "
                     f"{statistics.mean(c):.2f} |")  # fmt: skip
    step_wall = (steps[-1]["s0"][0] - steps[0]["s0"][0]) / n
    cpu = (steps[-1]["sched"][0] - steps[0]["sched"][0]) / n
    queued = (steps[-1]["sched"][1] - steps[0]["sched"][1]) / n
    blocked = step_wall - cpu - queued
    lines += ["", f"A step: {step_wall * 1e3:.2f} ms wall = {cpu * 1e3:.2f} ms running + "
              f"{queued * 1e3:.2f} ms in the run queue + {blocked * 1e3:.2f} ms blocked "
              "(the GIL, or no step queued)", ""]  # fmt: skip
    spent = {names.get(t, str(t)): (last[t] - before.get(t, 0.0)) / n * 1e3 for t in last}
    others = {name: ms for name, ms in spent.items() if not name.startswith("device-")}
    shown = ", ".join(f"{name} {ms:.2f}" for name, ms in
                      sorted(others.items(), key=lambda kv: -kv[1]) if ms >= 0.05)  # fmt: skip
    lines.append(f"The process's other threads, CPU ms per step (10 ms ticks): {shown or 'none'} "
                 f"(sum {sum(others.values()):.2f}: at most that much GIL taken from the "
                 "device)")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_wait", description=__doc__)
    p.add_argument("--requests", type=int, default=192, help="streaming requests (default 192)")
    p.add_argument("--running", type=int, default=64, help="the runner's max_running (64)")
    p.add_argument("--max-new", type=int, default=48, help="tokens a request (48)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--switch", type=float, nargs="*", default=[],
                   help="sys.setswitchinterval values, one run each (default: as it is)")  # fmt: skip
    args = p.parse_args(argv)
    from .generation import tiny_llama

    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="bench-wait-") as tmp:
        model_dir = tiny_llama(Path(tmp))
        for interval in args.switch or [sys.getswitchinterval()]:
            sys.setswitchinterval(interval)
            print("\n".join(run_once(url, model_dir, args)), "", sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
