"""Helpers shared by the batching tests: request builders and a virtual-time driver.

(A plain module, not a conftest: ``tests/`` is not a package and other suites own theirs.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batchfleet.batching.engine import Engine
from batchfleet.batching.types import Batch, Policy, Waiting


def req(
    key: str,
    arrived: float = 0.0,
    *,
    lane: int = 0,
    tokens: int = 10,
    size: int = 1,
    deadline: float | None = None,
) -> Waiting:
    return Waiting(key, lane, arrived, tokens, size, deadline)


def trained(
    policy: Policy, a: float = 0.020, b: float = 0.001, c: float = 0.0, d: float = 0.0
) -> Engine:
    """An engine that has already measured the cost ``a + b·rows + c·padded + d·rows·padded``
    at many shapes: about as many batches as the fit remembers (decay 0.995), so the
    ridge toward the prior no longer shows (with a strong ``d``, one pass of 27 batches
    leaves small batches ~10% off)."""
    engine = Engine(policy)
    for _ in range(8):
        for rows in (1, 2, 4, 8, 16, 32, 3, 12, 24):
            for tok in (8, 32, 64):
                batch = Batch(tuple(req(f"t{i}", tokens=tok) for i in range(rows)), "full")
                padded = rows * tok
                engine.observe(batch, a + b * rows + c * padded + d * rows * padded)
    return engine


Cost = Callable[[Batch], float]


@dataclass
class Run:
    """What a virtual-time run of one engine did."""

    dispatched: list[tuple[Batch, float, float]] = field(default_factory=list)
    expired: list[tuple[Waiting, float]] = field(default_factory=list)
    calls: int = 0


def drive(engine: Engine, trace: Sequence[Waiting], cost: Cost, *, max_calls: int = 200_000) -> Run:
    """Feed ``trace`` to ``engine`` as a worker would (holding everything that arrived),
    in virtual time; fail if the engine stalls (idle device, requests held, no wake)."""
    run = Run()
    pending = sorted(trace, key=lambda w: w.arrived)
    held: dict[str, Waiting] = {}
    busy_until: float | None = None
    wake: float | None = None
    i = 0
    now = pending[0].arrived if pending else 0.0
    while i < len(pending) or held or busy_until is not None:
        while i < len(pending) and pending[i].arrived <= now:
            held[pending[i].key] = pending[i]
            i += 1
        if busy_until is not None and now >= busy_until:
            busy_until = None
        run.calls += 1
        assert run.calls < max_calls, "engine is spinning"
        plan = engine.plan(list(held.values()), now, busy_until)
        for w in plan.expired:
            assert w.key in held, "expired a request it was not given"
            del held[w.key]
            run.expired.append((w, now))
        if plan.batch is not None:
            assert busy_until is None, "dispatched while the device was busy"
            for w in plan.batch.items:
                assert w.key in held, "dispatched a request it was not given"
                del held[w.key]
            seconds = cost(plan.batch)
            run.dispatched.append((plan.batch, now, now + seconds))
            engine.observe(plan.batch, seconds)
            busy_until = now + seconds
        wake = plan.wake_at
        if plan.batch is None and wake is not None:
            assert wake > now, "wake_at not in the future"
        times = [t for t in (wake, busy_until) if t is not None]
        if i < len(pending):
            times.append(pending[i].arrived)
        if not times:
            assert not held, f"stalled with {len(held)} held and an idle device"
            break
        now = max(now, min(times))
    return run
