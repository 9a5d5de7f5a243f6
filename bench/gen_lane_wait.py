"""``python -m bench.gen_lane_wait``: admission wait per lane of the generation policy under
overload, in virtual time (no model, no Redis).

``GenerationPolicy`` (``batching/generation.py``) plans a 16-slot running batch; each step
lasts ``--step-ms`` and gives every running sequence one token; requests arrive Poisson
at ``--rate`` (lanes 0/1/2 in a 20/50/30 mix, prompts 8-512, outputs 8-256 tokens), well
above what the slots serve. Preempted requests wait again with what they generated.
Prints each lane's admission wait (first admission - arrival).
"""

from __future__ import annotations

import argparse
import random

from batchfleet.batching.gen_types import GenPolicy, GenRunning, GenWaiting
from batchfleet.batching.generation import GenerationPolicy

from .load import LANE_MIX


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gen_lane_wait", description=__doc__.splitlines()[0]
    )
    p.add_argument("--rate", type=float, default=10.0, help="arrivals per second")
    p.add_argument("-n", type=int, default=200, help="requests")
    p.add_argument("--step-ms", type=float, default=30.0)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    policy = GenerationPolicy(GenPolicy(kv_cache_tokens=16384, page_size=32, step_tokens=256,
                                        max_running=args.max_running))  # fmt: skip
    rng = random.Random(args.seed)
    arrivals = []
    t = 0.0
    for i in range(args.n):
        t += rng.expovariate(args.rate)
        lane = rng.choices(range(len(LANE_MIX)), weights=LANE_MIX)[0]
        arrivals.append(
            GenWaiting(f"r{i}", lane, t, None, (rng.randint(8, 512),), rng.randint(8, 256))
        )
    waiting: dict[str, GenWaiting] = {}
    running: dict[str, tuple[GenWaiting, float, int, int]] = {}  # request, started, context, left
    first: dict[str, tuple[int, float]] = {}
    preempted: dict[str, int] = {}
    now, i = 0.0, 0
    while i < len(arrivals) or waiting or running:
        while i < len(arrivals) and arrivals[i].arrived_at <= now:
            waiting[arrivals[i].key] = arrivals[i]
            i += 1
        live = [GenRunning(k, w.lane, w.arrived_at, None, s, (c,), (0,), left, preempted.get(k, 0))
                for k, (w, s, c, left) in running.items()]  # fmt: skip
        plan = policy.plan(list(waiting.values()), live, now)
        for k in plan.preempt:  # resumed later by recomputation
            w, _, c, left = running.pop(k)
            waiting[k] = GenWaiting(k, w.lane, w.arrived_at, None, (c,), left)
            preempted[k] = preempted.get(k, 0) + 1
        for k in plan.admit:
            w = waiting.pop(k)
            first.setdefault(k, (w.lane, now - w.arrived_at))
            running[k] = (w, now, w.prompts[0], w.max_new_tokens)
        for k, (w, s, c, left) in list(running.items()):
            if left <= 1:
                del running[k]
            else:
                running[k] = (w, s, c + 1, left - 1)
        now += args.step_ms / 1000
    for lane in range(len(LANE_MIX)):
        waits = sorted(v for ln, v in first.values() if ln == lane)
        if waits:
            print(f"lane {lane}: {len(waits)} requests, admission wait p50 "
                  f"{waits[len(waits) // 2]:.1f} s, p99 {waits[int(0.99 * (len(waits) - 1))]:.1f} s, "
                  f"max {waits[-1]:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
