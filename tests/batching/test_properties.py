"""Hypothesis properties of the engine over random traces, driven in virtual time."""

from __future__ import annotations

import random

from batchfleet.batching.types import Batch, Policy, Waiting
from batching_helpers import drive, trained
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

policies = st.builds(
    Policy,
    max_batch_size=st.integers(1, 12),
    max_wait_ms=st.floats(0, 30),
    max_batch_tokens=st.one_of(st.none(), st.integers(20, 400)),
    preferred_batch_sizes=st.sampled_from([(), (2, 4), (4, 8)]),
    max_starvation_ms=st.floats(20, 500),
    adaptive=st.booleans(),
)


@st.composite
def traces(draw: st.DrawFn) -> list[Waiting]:
    n = draw(st.integers(1, 60))
    rate = draw(st.sampled_from([5.0, 100.0, 1000.0, 5000.0]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    with_deadlines = draw(st.booleans())
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        deadline = t + rng.uniform(0.0, 0.2) if with_deadlines and rng.random() < 0.7 else None
        out.append(
            Waiting(
                f"k{i}",
                rng.choice([0, 0, 1, 2]),
                t,
                rng.randint(1, 100),
                rng.randint(1, 3),
                deadline,
            )
        )
    return out


costs = st.tuples(
    st.floats(0.001, 0.03),
    st.floats(0.0, 0.002),
    st.floats(0.0, 0.0001),
    st.sampled_from([0.0, 0.0, 5e-7, 2e-6]),  # a CPU's rows x padded-tokens term (MiniLM: 5.4e-7)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), policy=policies, cost=costs)
def test_every_request_once_within_caps_and_deadlines(
    trace: list[Waiting], policy: Policy, cost: tuple[float, float, float, float]
) -> None:
    a, b, c, d = cost

    def seconds(batch: Batch) -> float:
        padded = batch.padded_tokens
        return a + b * batch.rows + c * padded + d * batch.rows * padded

    engine = trained(policy, a, b, c, d)
    promised: list[tuple[Batch, float]] = []
    original = engine.plan

    def plan_and_record(*args, **kwargs):  # type: ignore[no-untyped-def]
        plan = original(*args, **kwargs)
        if plan.batch is not None:
            promised.append(
                (plan.batch, engine.estimate(plan.batch.rows, plan.batch.padded_tokens))
            )
        return plan

    engine.plan = plan_and_record  # type: ignore[method-assign]
    run = drive(engine, trace, seconds)

    # Every request dispatched or expired, exactly once.
    keys = [w.key for b, _, _ in run.dispatched for w in b.items] + [w.key for w, _ in run.expired]
    assert sorted(keys) == sorted(w.key for w in trace)
    for batch, start, end in run.dispatched:
        # Caps, unless a single request is over them on its own.
        if len(batch.items) > 1:
            assert batch.rows <= policy.max_batch_size
            if policy.max_batch_tokens is not None:
                assert batch.padded_tokens <= policy.max_batch_tokens
        for w in batch.items:
            assert w.arrived <= start
            if w.deadline is not None:
                assert start < w.deadline
                # Measured finish: within the cost fit's error (a few %) of the estimate.
                assert end <= w.deadline + 0.05 * (end - start) + 1e-9
    for (batch, est), (b2, start, _) in zip(promised, run.dispatched, strict=True):
        assert batch is b2
        for w in batch.items:
            if w.deadline is not None:
                assert start + est <= w.deadline  # the engine's own promise, exactly


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), bound_ms=st.sampled_from([100.0, 200.0]))
def test_low_lane_wait_bounded_under_top_lane_overload(seed: int, bound_ms: float) -> None:
    # Capacity 4 rows / 14 ms ≈ 286/s; lane 0 offers 1.5x that, lane 2 a trickle.
    policy = Policy(max_batch_size=4, max_starvation_ms=bound_ms, lane_weights=(4.0, 2.0, 1.0))
    rng = random.Random(seed)
    trace: list[Waiting] = []
    t = 0.0
    while t < 1.0:
        t += rng.expovariate(430.0)
        trace.append(Waiting(f"a{len(trace)}", 0, t, 16))
    t = 0.0
    while t < 1.0:
        t += rng.expovariate(15.0)
        trace.append(Waiting(f"c{len(trace)}", 2, t, 16))

    def seconds(batch: Batch) -> float:
        return 0.010 + 0.001 * batch.rows

    run = drive(trained(policy, 0.010, 0.001), trace, seconds)
    batch_time = seconds(Batch(tuple(trace[:4]), "full"))
    waits = [start - w.arrived for b, start, _ in run.dispatched for w in b.items if w.lane == 2]
    assert waits and max(waits) <= bound_ms / 1000 + batch_time
    lane0 = [start - w.arrived for b, start, _ in run.dispatched for w in b.items if w.lane == 0]
    assert max(lane0) > bound_ms / 1000  # lane 0 really was saturated
