"""Discrete-event simulator: a trace, a batch-cost model, N workers, in virtual time.

The fleet is modelled as the product runs it: requests enter one shared queue (a Redis
stream per lane); each worker has its own :class:`~.engine.Engine` and reads from the
queue only what ``read_budget`` allows, shared over the lanes' streams by lane weight
(:func:`~.lanes.split_budget`), so nothing is hoarded while others idle. An
arrival is delivered to a worker that is listening (its budget is above 0): an idle one
first (the one already holding the most, so batches form), else the busy one holding
the least. Each worker calls ``plan`` on each read, when its device frees up and when a
``wake_at`` passes, and reports measured batch times back through ``observe``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .engine import Engine
from .lanes import split_budget
from .report import SimReport, build_report
from .types import Batch, Policy, Waiting

_DONE = 0
_WAKE = 1


class BatchCost(Protocol):
    """How long a batch takes: a formula here, or a real model run (``bench/replay.py``)."""

    @property
    def a(self) -> float:
        """Seconds a batch that runs out of memory costs."""
        ...

    def seconds(self, batch: Batch, rng: random.Random) -> float: ...


@dataclass(frozen=True, slots=True)
class LinearCost:
    """Batch time ``a + b·rows + c·padded_tokens`` seconds, times ``1 ± jitter``."""

    a: float = 0.020
    b: float = 0.001
    c: float = 0.0
    jitter: float = 0.0

    def seconds(self, batch: Batch, rng: random.Random) -> float:
        t = self.a + self.b * batch.rows + self.c * batch.padded_tokens
        if self.jitter:
            t *= 1.0 + self.jitter * (2.0 * rng.random() - 1.0)
        return t

    def limit(self, max_batch_size: int, tokens: int = 0) -> float:
        """Requests/s one device sustains with full batches of ``tokens``-long rows."""
        rows = max_batch_size
        return rows / (self.a + self.b * rows + self.c * rows * tokens)


@dataclass(slots=True)
class _Worker:
    engine: Engine
    held: dict[str, Waiting] = field(default_factory=dict)
    busy_until: float | None = None
    batch: Batch | None = None
    oom: bool = False
    started: float = 0.0
    wake_version: int = 0


@dataclass(slots=True)
class _Record:
    dispatched: list[tuple[Waiting, float, float]] = field(default_factory=list)
    expired: list[Waiting] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    ooms: int = 0
    plan_calls: int = 0


def simulate(
    trace: Sequence[Waiting],
    policy: Policy,
    cost: BatchCost | None = None,
    workers: int = 1,
    *,
    memory_tokens: int | None = None,
    share_window: tuple[float, float] | None = None,
    seed: int = 0,
) -> SimReport:
    """Run ``trace`` through ``workers`` workers with ``policy``; report what happened.

    ``memory_tokens``: a batch with more padded tokens runs out of memory (it costs
    its fixed overhead, its requests go back to waiting, the engine is told).
    ``share_window``: also report each lane's share of the rows dispatched in that
    span of time (``extra["share_lane<N>"]``), e.g. while every lane is backlogged.
    """
    cost = cost or LinearCost()
    rng = random.Random(seed)
    fleet = [_Worker(Engine(policy)) for _ in range(max(1, workers))]
    queue: dict[int, deque[Waiting]] = {}
    rec = _Record()
    events: list[tuple[float, int, int, int, int]] = []  # time, seq, kind, worker, version
    seq = 0

    def push(t: float, kind: int, wid: int, version: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, wid, version))

    def poke(wid: int, now: float) -> None:
        w = fleet[wid]
        budget = w.engine.read_budget(len(w.held))
        if budget > 0:
            lanes = [lane for lane in sorted(queue) if queue[lane]]
            counts = split_budget(budget, lanes, w.engine.policy)
            for first_pass in (True, False):  # weighted shares, then leftovers in lane order
                for lane in lanes:
                    q = queue[lane]
                    take = min(counts[lane] if first_pass else budget, len(q), budget)
                    budget -= take
                    for _ in range(take):
                        item = q.popleft()
                        w.held[item.key] = item
        if not w.held:
            return
        rec.plan_calls += 1
        plan = w.engine.plan(list(w.held.values()), now, w.busy_until)
        for item in plan.expired:
            del w.held[item.key]
            rec.expired.append(item)
        if plan.batch is not None:
            batch = plan.batch
            for item in batch.items:
                del w.held[item.key]
            oom = memory_tokens is not None and batch.padded_tokens > memory_tokens
            seconds = cost.a if oom else cost.seconds(batch, rng)
            w.busy_until, w.batch, w.oom, w.started = now + seconds, batch, oom, now
            push(now + seconds, _DONE, wid)
        w.wake_version += 1
        if plan.wake_at is not None:
            push(max(plan.wake_at, now), _WAKE, wid, w.wake_version)

    def finish(wid: int, now: float) -> None:
        w = fleet[wid]
        batch = w.batch
        assert batch is not None
        if w.oom:
            rec.ooms += 1
            w.engine.out_of_memory(batch, now)
            for item in batch.items:
                w.held[item.key] = item
        else:
            w.engine.observe(batch, now - w.started)
            rec.batches.append(batch)
            for item in batch.items:
                rec.dispatched.append((item, w.started, now))
        w.busy_until, w.batch, w.oom = None, None, False

    i, n = 0, len(trace)
    while i < n or events:
        t_arrival = trace[i].arrived if i < n else math.inf
        if events and events[0][0] < t_arrival:
            t, _, kind, wid, version = heapq.heappop(events)
            if kind == _DONE:
                finish(wid, t)
            elif version != fleet[wid].wake_version:
                continue
            poke(wid, t)
            continue
        item = trace[i]
        i += 1
        q = queue.get(item.lane)
        if q is None:
            q = queue[item.lane] = deque()
        q.append(item)
        listener = _listener(fleet)
        if listener is not None:
            poke(listener, item.arrived)

    stuck = sum(len(q) for q in queue.values()) + sum(len(w.held) for w in fleet)
    return build_report(
        requests=n,
        dispatched=rec.dispatched,
        expired=rec.expired,
        batches=rec.batches,
        ooms=rec.ooms,
        stuck=stuck,
        plan_calls=rec.plan_calls,
        share_window=share_window,
    )


def _listener(fleet: list[_Worker]) -> int | None:
    """The worker an arrival goes to, or None when every one is at its read budget."""
    best: tuple[int, int, int] | None = None
    for wid, w in enumerate(fleet):
        held = len(w.held)
        if w.engine.read_budget(held) <= 0:
            continue
        # Idle before busy; among idle the fullest (batches form), among busy the emptiest.
        key = (0, -held, wid) if w.busy_until is None else (1, held, wid)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]
