"""Continuous batching in virtual time: a generation trace, a step-cost model, one device.

The loop is the worker's: before each step it asks :class:`~.generation.GenerationPolicy`
for a plan and applies it (stop, expire, preempt back to waiting, admit), shares the
step's tokens with :func:`~.gen_blocks.schedule_step`, and advances the clock by the cost
model's step time. A sequence that finishes its prompt produces its first token in that
step (time to first token ends there), then one token per step until its drawn length.
A preempted request comes back with its prompt plus what it generated (recomputation).
Every step is checked against the budgets; breaches are reported, not raised, so a
property test can show them all.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .gen_blocks import schedule_step, step_blocks
from .gen_sim_live import GenRequest, Live, child_key
from .gen_types import GenPolicy
from .generation import GenerationPolicy
from .report import percentile

__all__ = ["GenRequest", "GenSimReport", "StepCost", "gen_poisson", "simulate_generation"]


def gen_poisson(
    n: int,
    rate: float,
    *,
    lanes: Sequence[float] = (0.2, 0.3, 0.5),
    prompt: tuple[int, int] = (8, 512),
    output: tuple[int, int] = (8, 256),
    inputs: tuple[int, int] = (1, 1),
    completions: tuple[int, int] = (1, 1),
    deadline_s: tuple[float, float] | None = None,
    start: float = 0.0,
    prefix: str = "g",
    seed: int = 0,
) -> list[GenRequest]:
    """``n`` Poisson arrivals at ``rate``/s over lanes drawn with weights ``lanes``:
    prompts and ``max_new_tokens`` uniform in their ranges, each sequence finishing at a
    uniform length in ``1..max_new_tokens``; ``completions``: ``n`` per input, uniform in
    the range (its sequences share their input's prompt); ``deadline_s``: a deadline that far after
    arrival (uniform in the range) on every request."""
    rng = random.Random(seed)
    t = start
    out: list[GenRequest] = []
    for i in range(n):
        t += rng.expovariate(rate)
        lane = rng.choices(range(len(lanes)), weights=lanes)[0]
        k = rng.randint(*inputs)
        max_new = rng.randint(*output)
        deadline = None if deadline_s is None else t + rng.uniform(*deadline_s)
        each = rng.randint(*completions) if completions != (1, 1) else 1
        prompts = tuple(p for _ in range(k) for p in (rng.randint(*prompt),) * each)
        lengths = tuple(rng.randint(1, max_new) for _ in prompts)
        out.append(GenRequest(f"{prefix}{i}", lane, t, prompts, max_new, lengths, deadline))
    return out


@dataclass(frozen=True, slots=True)
class StepCost:
    """Step time ``a + b·tokens_in_step + c·kv_tokens_read`` seconds (attention reads every
    sequence's context)."""

    a: float = 0.005
    b: float = 2e-5
    c: float = 2e-7

    def seconds(self, tokens: int, kv_read: int) -> float:
        return self.a + self.b * tokens + self.c * kv_read


@dataclass(frozen=True, slots=True)
class GenLaneReport:
    lane: int
    requests: int
    finished: int
    stopped: int
    expired: int
    refused: int
    """Never started: they could never fit the cache or ``max_running`` (``refuse``)."""
    ttft_p50: float
    ttft_p99: float
    wait_max: float
    """Longest arrival → first admission (the starvation bound is on this)."""
    output_tokens: int


@dataclass(frozen=True, slots=True)
class GenSimReport:
    lanes: tuple[GenLaneReport, ...]
    requests: int
    finished: int
    stopped: int
    expired: int
    refused: int
    preemptions: int
    steps: int
    duration: float
    tokens_per_s: float
    """Output tokens per second of the whole run (first arrival to last step)."""
    max_step_tokens: int
    max_step_blocks: int
    max_running: int
    violations: tuple[str, ...]
    """Budget breaches, keys planned twice or unknown, requests ended twice or never."""

    def lane(self, lane: int) -> GenLaneReport:
        return next(r for r in self.lanes if r.lane == lane)

    def table(self) -> str:
        head = ("lane  requests  finished stopped expired refused  ttft_p50 ttft_p99  wait_max"
                "  tokens")  # fmt: skip
        rows = [
            f"{r.lane:>4} {r.requests:>9} {r.finished:>9} {r.stopped:>7} {r.expired:>7}"
            f" {r.refused:>7}"
            f" {r.ttft_p50 * 1000:>7.1f}ms {r.ttft_p99 * 1000:>6.1f}ms"
            f" {r.wait_max * 1000:>7.1f}ms {r.output_tokens:>7}"
            for r in self.lanes
        ]
        tail = (
            f"{self.tokens_per_s:.0f} tokens/s over {self.duration:.2f}s, {self.steps} steps,"
            f" {self.preemptions} preemptions, max {self.max_step_tokens} tokens and"
            f" {self.max_step_blocks} blocks in a step, {len(self.violations)} violations"
        )
        return "\n".join([head, *rows, tail])


def simulate_generation(
    trace: Sequence[GenRequest],
    policy: GenPolicy,
    cost: StepCost | None = None,
    *,
    max_steps: int = 2_000_000,
) -> GenSimReport:
    """Run ``trace`` (sorted by arrival) through one device with ``policy``; report it."""
    cost = cost or StepCost()
    gen = GenerationPolicy(policy)
    pending = deque(sorted(trace, key=lambda r: r.arrived))
    lives: dict[str, Live] = {}
    waiting: dict[str, Live] = {}
    running: dict[str, Live] = {}
    outcome: dict[str, str] = {}
    violations: list[str] = []
    now = pending[0].arrived if pending else 0.0
    first = now
    steps = preemptions = max_tokens = max_blocks = max_seqs = 0

    def end(key: str, how: str) -> None:
        if key in outcome:
            violations.append(f"{key} ended twice ({outcome[key]}, {how})")
        outcome[key] = how

    while pending or waiting or running:
        while pending and pending[0].arrived <= now:
            req = pending.popleft()
            live = Live(req, [0] * len(req.prompts), alive=list(range(len(req.prompts))))
            lives[req.key] = waiting[req.key] = live
        if not waiting and not running:
            now = pending[0].arrived
            continue
        children = {w.key: (w, r) for r in running.values() for w in r.children()}
        plan = gen.plan(
            [*(w.as_waiting() for w in waiting.values()), *(w for w, _ in children.values())],
            [r.as_running() for r in running.values()],
            now,
        )
        parts = tuple(k for k, _ in plan.preempt_seqs)
        refused = tuple(k for k, _ in plan.refuse)
        _check_plan(plan.admit + plan.expire + refused, plan.preempt + plan.stop + parts,
                    {*waiting, *children}, running, violations)  # fmt: skip
        for key in plan.stop:
            end(key, "stopped")
            del running[key]
        for key in plan.expire + refused:
            if key in children:  # a sequence alone outgrew the cache: its request stops
                parent = children[key][1].req.key
                if running.pop(parent, None) is not None:
                    end(parent, "stopped")
                continue
            live = waiting.pop(key)  # one that generated stops with its text, as the worker's
            unrun = "expired" if key in plan.expire else "refused"
            end(key, "stopped" if live.first_token is not None else unrun)
        for key, ids in plan.preempt_seqs:
            preemptions += len(ids)  # per sequence, as vLLM counts its child requests
            running[key].park(ids)
        for key in plan.preempt:
            preemptions += len(running[key].alive)
            waiting[key] = running.pop(key)
            waiting[key].park_all()
        for key in plan.admit:
            if key in children:
                w, live = children[key]
                if w.parent not in running or w.parent in parts + plan.preempt:
                    violations.append(f"{key} resumed into {w.parent}, not running on")
                    continue
                live.resume(next(i for i in live.parked if child_key(live.req.key, i) == key))
                continue
            live = waiting.pop(key)
            live.start(now)
            running[key] = live
        if not running:
            if not waiting:
                continue  # the next arrival, if any, at the top of the loop
            if plan.wake_at is None and not pending:
                violations.append(f"stuck at {now:.6f} with {len(waiting)} waiting")
                break
            now = min(
                t for t in (plan.wake_at, pending[0].arrived if pending else None) if t is not None
            )
            continue
        batch = [r.as_running() for r in running.values()]
        chunks = schedule_step(batch, policy.step_tokens)
        tokens = sum(sum(c) for c in chunks.values())
        blocks = step_blocks(batch, chunks, policy.page_size)
        seqs = sum(len(r.contexts) for r in batch)
        if tokens > policy.step_tokens or blocks > policy.total_blocks or seqs > policy.max_running:
            violations.append(
                f"step at {now:.6f}: {tokens} tokens, {blocks} blocks, {seqs} sequences"
            )
        max_tokens, max_blocks, max_seqs = (
            max(max_tokens, tokens),
            max(max_blocks, blocks),
            max(max_seqs, seqs),
        )
        kv_read = sum(c + a for r in batch for c, a in zip(r.contexts, chunks[r.key], strict=True))
        now += cost.seconds(tokens, kv_read)
        steps += 1
        if steps > max_steps:
            violations.append("ran past max_steps")
            break
        for key in list(running):
            live = running[key]
            live.advance(chunks[key], now)
            if live.done:
                end(key, "finished")
                del running[key]

    for req in trace:
        if req.key not in outcome:
            violations.append(f"{req.key} never ended")
    return GenSimReport(
        lanes=_lane_reports(lives, outcome),
        requests=len(trace),
        finished=sum(1 for how in outcome.values() if how == "finished"),
        stopped=sum(1 for how in outcome.values() if how == "stopped"),
        expired=sum(1 for how in outcome.values() if how == "expired"),
        refused=sum(1 for how in outcome.values() if how == "refused"),
        preemptions=preemptions,
        steps=steps,
        duration=now - first,
        tokens_per_s=sum(sum(v.generated) for v in lives.values()) / max(now - first, 1e-12),
        max_step_tokens=max_tokens,
        max_step_blocks=max_blocks,
        max_running=max_seqs,
        violations=tuple(violations),
    )


def _check_plan(
    from_waiting: tuple[str, ...],
    from_running: tuple[str, ...],
    waiting: set[str],
    running: dict[str, Live],
    violations: list[str],
) -> None:
    keys = from_waiting + from_running
    if len(set(keys)) != len(keys):
        violations.append(f"a key in two lists of one plan: {sorted(keys)}")
    unknown = [k for k in from_waiting if k not in waiting]
    unknown += [k for k in from_running if k not in running]
    if unknown:
        violations.append(f"unknown keys planned: {unknown}")


def _lane_reports(lives: dict[str, Live], outcome: dict[str, str]) -> tuple[GenLaneReport, ...]:
    by_lane: dict[int, list[Live]] = {}
    for live in lives.values():
        by_lane.setdefault(live.req.lane, []).append(live)
    out = []
    for lane in sorted(by_lane):
        group = by_lane[lane]
        ttft = sorted(v.first_token - v.req.arrived for v in group if v.first_token is not None)
        waits = [v.first_admit - v.req.arrived for v in group if v.first_admit is not None]
        hows = [outcome.get(v.req.key) for v in group]
        out.append(
            GenLaneReport(
                lane=lane,
                requests=len(group),
                finished=hows.count("finished"),
                stopped=hows.count("stopped"),
                expired=hows.count("expired"),
                refused=hows.count("refused"),
                ttft_p50=percentile(ttft, 50),
                ttft_p99=percentile(ttft, 99),
                wait_max=max(waits, default=0.0),
                output_tokens=sum(sum(v.generated) for v in group),
            )
        )
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m batchfleet.batching.gen_simulator``: the tables of docs/batching.md."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rates", default="0.5,40,60,100", help="requests/s, comma-separated")
    parser.add_argument("-n", type=int, default=1500, help="requests per run")
    parser.add_argument("--kv", type=int, default=16384, help="KV cache tokens")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    policy = GenPolicy(kv_cache_tokens=args.kv, page_size=16, step_tokens=512, max_running=32)
    for rate in (float(r) for r in args.rates.split(",")):
        report = simulate_generation(gen_poisson(args.n, rate, seed=args.seed), policy)
        print(f"rate {rate:g}/s, lanes 20/30/50%, {policy}\n{report.table()}\n")


if __name__ == "__main__":
    main()
