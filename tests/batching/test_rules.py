"""Table-driven tests of each batching rule (one engine call per case, virtual time)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from batchfleet.batching.engine import Engine
from batchfleet.batching.types import Batch, Policy, Waiting
from batching_helpers import req, trained

FIXED = Policy(adaptive=False)


@dataclass
class Case:
    name: str
    policy: Policy
    waiting: list[Waiting]
    now: float
    busy_until: float | None = None
    reason: str | None = None
    """Expected reason; None: no batch."""
    keys: list[str] | None = None
    """Expected batch keys in any order (None: not checked)."""
    expired: list[str] | None = None
    wake_at: float | None = None


CASES = [
    Case("idle device, one request: no window paid", Policy(), [req("a")], 0.0, reason="idle"),
    Case(
        "fixed window: waits until the oldest has waited max_wait_ms",
        FIXED,
        [req("a", 0.0), req("b", 0.004)],
        0.005,
        wake_at=0.010,
    ),
    Case(
        "fixed window: runs out",
        FIXED,
        [req("a"), req("b", 0.004)],
        0.0101,
        reason="window",
        keys=["a", "b"],
    ),
    Case(
        "full at max_batch_size, oldest first",
        Policy(max_batch_size=3),
        [req("d", 0.4), req("a", 0.1), req("c", 0.3), req("b", 0.2)],
        0.5,
        reason="full",
        keys=["a", "b", "c"],
    ),
    Case(
        "rows count sizes",
        Policy(max_batch_size=4),
        [req("a", 0.1, size=3), req("b", 0.2, size=2), req("c", 0.3)],
        0.5,
        reason="full",
        keys=["a", "c"],
    ),
    Case(
        "padded-token cap: longest x rows",
        Policy(max_batch_tokens=100),
        [req(k, i / 10, tokens=30) for i, k in enumerate("abcd")],
        0.5,
        reason="full",
        keys=["a", "b", "c"],
    ),
    Case(
        "a request over the token cap still goes alone",
        Policy(max_batch_tokens=100),
        [req("big", 0.0, tokens=500), req("b", 0.1, tokens=5)],
        0.5,
        reason="full",
        keys=["big"],
    ),
    Case(
        "higher lane first, even if younger",
        Policy(max_batch_size=2),
        [req("low", 0.0, lane=2), req("mid", 0.1, lane=1), req("top", 0.2, lane=0)],
        0.3,
        reason="full",
        keys=["top", "mid"],
    ),
    Case(
        "busy device: no batch, wake when it frees",
        Policy(),
        [req("a")],
        0.0,
        busy_until=0.05,
        wake_at=0.05,
    ),
    Case(
        "deadline it cannot meet: expired, not computed",
        Policy(),
        [req("late", 0.0, deadline=0.010), req("ok", 0.0)],
        0.0,
        reason="idle",
        keys=["ok"],
        expired=["late"],
    ),
    Case(
        "busy until past what a deadline allows: expired now",
        Policy(),
        [req("late", 0.0, deadline=0.060)],
        0.0,
        busy_until=0.050,
        expired=["late"],
    ),
    Case(
        "a lower lane at its starvation bound is promoted into a full batch",
        Policy(max_batch_size=5, max_starvation_ms=100),
        [req("old", 0.0, lane=2)] + [req(f"x{i}", 0.09 + i / 1000) for i in range(6)],
        0.095,
        reason="starvation",
        keys=["old", "x0", "x1", "x2", "x3"],
    ),
    Case(
        "before its bound it waits behind lane 0",
        Policy(max_batch_size=2, max_starvation_ms=1000),
        [req("old", 0.0, lane=2), req("x", 0.09), req("y", 0.091), req("z", 0.092)],
        0.095,
        reason="full",
        keys=["x", "y"],
    ),
    Case(
        "preferred sizes: trimmed to the largest one it reaches",
        Policy(adaptive=False, preferred_batch_sizes=(4, 8)),
        [req(f"r{i:02}", i / 1000) for i in range(11)],
        0.5,
        reason="window",
        keys=[f"r{i:02}" for i in range(8)],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule(case: Case) -> None:
    engine = trained(case.policy)
    shuffled = list(case.waiting)
    random.Random(0).shuffle(shuffled)  # input order must not matter
    plan = engine.plan(shuffled, case.now, case.busy_until)
    if case.reason is None:
        assert plan.batch is None
    else:
        assert plan.batch is not None
        assert plan.batch.reason == case.reason
        if case.keys is not None:
            assert sorted(w.key for w in plan.batch.items) == sorted(case.keys)
    assert sorted(w.key for w in plan.expired) == sorted(case.expired or [])
    if case.wake_at is not None:
        assert plan.wake_at == pytest.approx(case.wake_at)


def test_deadline_limits_batch_size() -> None:
    # 0.020 + 0.001·rows must finish by 0.025: at most 5 rows go with the head.
    engine = trained(Policy())
    waiting = [req("head", 0.0, deadline=0.025)] + [req(f"r{i}", 0.001 * i) for i in range(1, 10)]
    plan = engine.plan(waiting, 0.0)
    assert plan.batch is not None
    assert "head" in [w.key for w in plan.batch.items]
    assert plan.batch.rows <= 5
    assert engine.estimate(plan.batch.rows, plan.batch.padded_tokens) <= 0.025


def test_deadline_forces_early_dispatch() -> None:
    engine = trained(Policy(adaptive=False, max_wait_ms=50))
    waiting = [req("a", 0.0, deadline=0.030)]
    plan = engine.plan(waiting, 0.0)
    assert plan.batch is None and plan.wake_at is not None
    assert plan.wake_at + engine.estimate(1, 10) <= 0.030
    plan = engine.plan(waiting, plan.wake_at)
    assert plan.batch is not None and plan.batch.reason == "deadline"


def test_adaptive_waits_at_high_rate_and_not_at_low() -> None:
    engine = trained(Policy(max_wait_ms=20))
    # It has seen 200 arrivals at 500/s (λ·a = 10 rows): a lone request is worth waiting for.
    history = [req(f"h{i}", i / 500) for i in range(200)]
    engine.plan(history, 0.4, busy_until=0.5)
    plan = engine.plan([history[-1]], 0.4)
    assert plan.batch is None
    assert plan.wake_at is not None and 0.4 < plan.wake_at <= history[-1].arrived + 0.020
    # With λ·a rows already waiting, it goes at once.
    plan = engine.plan(history[-12:], 0.4)
    assert plan.batch is not None and plan.batch.reason == "idle"
    # At 5 req/s (λ·a = 0.1) a lone request goes at once.
    slow = trained(Policy(max_wait_ms=20))
    slow.plan([req(f"s{i}", i / 5) for i in range(20)], 4.0, busy_until=4.1)
    plan = slow.plan([req("x", 4.0)], 4.0)
    assert plan.batch is not None and plan.batch.reason == "idle"


def test_adaptive_never_waits_past_max_wait() -> None:
    engine = trained(Policy(max_wait_ms=5))
    engine.plan([req(f"h{i}", i / 1000) for i in range(200)], 0.2, busy_until=0.3)
    plan = engine.plan([req("x", 0.2)], 0.2)
    assert plan.wake_at is not None and plan.wake_at <= 0.205 + 1e-9
    plan = engine.plan([req("x", 0.2)], plan.wake_at)
    assert plan.batch is not None and plan.batch.reason == "window"


def test_length_grouping_keeps_oldest_and_cuts_padding() -> None:
    # Token-dominated cost: 10 ms + 0.05 ms per padded token.
    engine = trained(Policy(max_batch_size=8), a=0.010, b=0.0, c=0.00005)
    rng = random.Random(1)
    waiting = [req(f"r{i:02}", i / 1000, tokens=rng.choice([10, 12, 80, 90])) for i in range(32)]
    plan = engine.plan(waiting, 0.1)
    assert plan.batch is not None
    assert "r00" in [w.key for w in plan.batch.items]
    arrival = Batch(tuple(waiting[:8]), "full")
    assert plan.batch.padding_waste < arrival.padding_waste / 2


def test_rows_only_cost_keeps_arrival_order() -> None:
    # Reordering for length would buy nothing here: the oldest go, in order.
    engine = trained(Policy(max_batch_size=8))
    rng = random.Random(1)
    waiting = [req(f"r{i:02}", i / 1000, tokens=rng.choice([10, 80])) for i in range(32)]
    plan = engine.plan(waiting, 0.1)
    assert plan.batch is not None
    assert sorted(w.key for w in plan.batch.items) == [f"r{i:02}" for i in range(8)]


def test_starvation_promotions_keep_lane0_share() -> None:
    # Lane 2 flooded and starving: per batch it may take only its weighted share.
    policy = Policy(max_batch_size=10, max_starvation_ms=100, lane_weights=(4.0, 2.0, 1.0))
    engine = trained(policy)
    lane0 = [req(f"a{i:03}", 0.5 + i / 10000) for i in range(250)]
    lane2 = [req(f"c{i:03}", i / 10000, lane=2) for i in range(100)]
    taken2 = 0
    for step in range(20):
        plan = engine.plan(lane0 + lane2, 1.0 + step)
        assert plan.batch is not None
        taken2 += sum(1 for w in plan.batch.items if w.lane == 2)
        gone = {w.key for w in plan.batch.items}
        lane0 = [w for w in lane0 if w.key not in gone]
        lane2 = [w for w in lane2 if w.key not in gone]
    # Its saved-up credit (4 batches' share: 8 rows) at once, then its share 1/(4+1) of
    # each later batch's 10 rows.
    assert taken2 == 4 * 2 + 19 * 10 // 5


def test_out_of_memory_backs_off_and_probes_back_up() -> None:
    engine = trained(Policy(max_batch_size=32))
    waiting = [req(f"r{i:02}", i / 1000) for i in range(40)]
    first = engine.plan(waiting, 1.0).batch
    assert first is not None and first.rows == 32
    engine.out_of_memory(first, 1.0)
    after = engine.plan(waiting, 1.1).batch
    assert after is not None and after.rows == 16
    assert engine.read_budget(0) < 3 * 32
    rows = []
    for t in range(12, 200, 10):
        batch = engine.plan(waiting, float(t)).batch
        assert batch is not None
        rows.append(batch.rows)
    assert rows == sorted(rows) and rows[-1] == 32  # grew back step by step


def test_read_budget() -> None:
    engine = Engine(Policy(max_batch_size=8))
    assert engine.read_budget(0) >= 1
    assert engine.read_budget(0) <= 3 * 8
    assert engine.read_budget(1000) == 0


def test_cost_model_learns_and_survives_set_policy() -> None:
    engine = trained(Policy(), a=0.030, b=0.002, c=0.00001)
    assert engine.estimate(10, 400) == pytest.approx(0.030 + 0.02 + 0.004, rel=0.02)
    engine.set_policy(Policy(max_batch_size=4))
    assert engine.policy.max_batch_size == 4
    assert engine.estimate(10, 400) == pytest.approx(0.054, rel=0.02)


def test_untrained_estimate_is_positive() -> None:
    engine = Engine(Policy())
    assert 0 < engine.estimate(1, 10) < engine.estimate(32, 320)


def test_expired_returned_once() -> None:
    engine = trained(Policy())
    late = req("late", 0.0, deadline=0.001)
    assert [w.key for w in engine.plan([late], 0.0).expired] == ["late"]
    assert engine.plan([], 0.01).expired == ()
