"""``batchfleet simulate``: run a synthetic trace through the batching engine, print a table."""

from __future__ import annotations

import argparse
import sys
import time

from .simulator import LinearCost, simulate
from .traces import bursts, poisson
from .types import Policy


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchfleet simulate",
        description="Simulate the batching engine in virtual time on a synthetic trace "
        "and print throughput, latency per lane, batch sizes, padding and dispatch reasons.",
    )
    t = p.add_argument_group("trace")
    t.add_argument("--requests", "-n", type=int, default=100_000, help="requests (100000)")
    t.add_argument("--rate", type=float, default=400.0, help="mean arrivals per second (400)")
    t.add_argument("--trace", choices=["poisson", "bursts"], default="poisson")
    t.add_argument("--burst-rate", type=float, default=2000.0, help="rate during bursts")
    t.add_argument("--burst-every", type=float, default=1.0, help="seconds between bursts")
    t.add_argument("--burst-len", type=float, default=0.1, help="seconds a burst lasts")
    t.add_argument("--lanes", type=_floats, default=(1.0,), help="lane mix, e.g. 0.6,0.3,0.1")
    t.add_argument("--tokens", type=int, default=None, help="fixed length (default: 5-60 words)")
    t.add_argument("--deadline-ms", type=float, default=None, help="deadline after arrival")
    t.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("device")
    c.add_argument("--workers", type=int, default=1, help="workers sharing the queue (1)")
    c.add_argument(
        "--cost",
        type=_floats,
        default=(0.020, 0.001, 0.0),
        help="batch seconds a,b,c in a + b*rows + c*padded_tokens (0.020,0.001,0)",
    )
    c.add_argument("--jitter", type=float, default=0.0, help="run-time noise, e.g. 0.1 = ±10%%")
    c.add_argument("--memory-tokens", type=int, default=None, help="OOM above this many")
    k = p.add_argument_group("policy")
    k.add_argument("--max-batch-size", type=int, default=32)
    k.add_argument("--max-wait-ms", type=float, default=10.0)
    k.add_argument("--max-batch-tokens", type=int, default=None)
    k.add_argument("--preferred", type=_ints, default=(), help="preferred sizes, e.g. 8,16,32")
    k.add_argument("--lane-weights", type=_floats, default=(4.0, 2.0, 1.0))
    k.add_argument("--max-starvation-ms", type=float, default=2000.0)
    k.add_argument("--fixed", action="store_true", help="plain fixed window (not adaptive)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the simulation, print its table; 0 on success, 2 on bad input."""
    args = build_parser().parse_args(argv)
    if args.requests <= 0 or args.rate <= 0 or len(args.cost) != 3:
        print("error: --requests and --rate must be positive, --cost needs a,b,c", file=sys.stderr)
        return 2
    common = {"lanes": args.lanes, "tokens": args.tokens, "deadline_ms": args.deadline_ms}
    if args.trace == "bursts":
        trace = bursts(
            args.requests,
            args.rate,
            args.burst_rate,
            period_s=args.burst_every,
            burst_s=args.burst_len,
            seed=args.seed,
            **common,
        )
    else:
        trace = poisson(args.requests, args.rate, seed=args.seed, **common)
    policy = Policy(
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_batch_tokens=args.max_batch_tokens,
        preferred_batch_sizes=args.preferred,
        lane_weights=args.lane_weights,
        max_starvation_ms=args.max_starvation_ms,
        adaptive=not args.fixed,
        lanes=max(len(args.lanes), 1),
    )
    a, b, c = args.cost
    cost = LinearCost(a, b, c, args.jitter)
    started = time.perf_counter()
    report = simulate(
        trace, policy, cost, args.workers, memory_tokens=args.memory_tokens, seed=args.seed
    )
    elapsed = time.perf_counter() - started
    print(report.format())
    print(f"\nsimulated {len(trace)} requests in {elapsed:.1f} s of CPU")
    return 0 if report.stuck == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
