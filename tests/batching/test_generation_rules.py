"""Table-driven tests of the generation policy's rules (one plan call per case, virtual time).

Most cases use page 1 (a block is a token) and no watermark, so the sums are easy to read:
a decoding sequence of context ``c`` reserves ``c + 1``; a waiting prompt ``p`` needs ``p + 1``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from batchfleet.batching.gen_admission import PREFILL_STEPS
from batchfleet.batching.gen_blocks import blocks_for, schedule_step, step_blocks
from batchfleet.batching.gen_types import GenPolicy, GenRunning, GenWaiting
from batchfleet.batching.generation import GenerationPolicy
from gen_helpers import gr, gw, tokens_policy


@dataclass
class Case:
    name: str
    policy: GenPolicy
    waiting: list[GenWaiting]
    running: list[GenRunning]
    now: float
    admit: list[str]
    """Expected admissions, in order."""
    preempt: list[str] | None = None
    """Expected preemptions, in order (default none)."""
    stop: list[str] | None = None
    expire: list[str] | None = None
    refuse: list[str] | None = None
    """Expected refusals (can never fit), any order."""
    wake_at: float | None = None
    """Checked when given."""


CASES = [
    Case(
        "a request with no prompt to hold (max_new_tokens 0) needs no block: it is answered",
        tokens_policy(kv=10),
        [gw("count", 0.1, prompts=(0, 0), max_new=0), gw("b", 0.2, prompts=(1,))],
        [gr("r", 0.0, contexts=(9,))],
        0.5,
        admit=["count"],
    ),
    Case(
        "lane order, oldest first within a lane",
        tokens_policy(),
        [gw("l2", 0.0, lane=2), gw("l1", 0.1, lane=1), gw("b", 0.3), gw("a", 0.2)],
        [],
        0.5,
        admit=["a", "b", "l1", "l2"],
    ),
    Case(
        "max_running counts sequences",
        tokens_policy(max_running=3),
        [gw("a", 0.1, prompts=(5, 5)), gw("b", 0.2, prompts=(5, 5)), gw("c", 0.3)],
        [],
        0.5,
        admit=["a"],
    ),
    Case(
        "max_running counts running sequences too",
        tokens_policy(max_running=3),
        [gw("a", 0.1), gw("b", 0.2)],
        [gr("r", contexts=(5, 5))],
        0.5,
        admit=["a"],
    ),
    Case(
        "KV: whole prompt + one token per sequence; the first that does not fit ends admission",
        tokens_policy(kv=100),
        [gw("a", 0.1, prompts=(39,)), gw("b", 0.2, prompts=(40,)), gw("c", 0.3, prompts=(5,))],
        [gr("r", contexts=(19,))],  # reserves 20
        0.5,
        admit=["a"],  # 20 + 40 = 60; b needs 41 → 101 > 100; c may not jump it
    ),
    Case(
        "KV: a prefilling request reserves its whole prompt",
        tokens_policy(kv=100),
        [gw("a", 0.1, prompts=(30,))],
        [gr("r", contexts=(10,), prefill=(60,))],  # reserves 10 + 60 + 1 = 71
        0.5,
        admit=[],
    ),
    Case(
        "page rounding: 15 tokens + 1 is one block of 16, 16 + 1 is two",
        tokens_policy(kv=48, page=16),
        [gw("a", 0.1, prompts=(15,)), gw("b", 0.2, prompts=(16,)), gw("c", 0.3, prompts=(1,))],
        [],
        0.5,
        admit=["a", "b"],  # 1 + 2 = 3 blocks = the cache; c needs 1 more
    ),
    Case(
        "page rounding: a cache of 40 tokens in pages of 16 has 2 blocks",
        tokens_policy(kv=40, page=16),
        [gw("a", 0.1, prompts=(20,)), gw("b", 0.2, prompts=(1,))],
        [],
        0.5,
        admit=["a"],
    ),
    Case(
        "watermark: admission leaves 5 of 100 blocks free",
        tokens_policy(kv=100, watermark=0.05),
        [gw("a", 0.1, prompts=(44,)), gw("b", 0.2, prompts=(1,))],
        [gr("r", contexts=(49,))],  # 50
        0.5,
        admit=["a"],  # 50 + 45 = 95 ok; b → 97 > 95
    ),
    Case(
        "watermark: running sequences may grow into it (no preemption below the cache)",
        tokens_policy(kv=100, watermark=0.05),
        [],
        [gr("r", contexts=(97,)), gr("s", 1.0, lane=2, contexts=(1,))],  # 98 + 2 = 100
        0.5,
        admit=[],
    ),
    Case(
        "never fits even alone (over the cache less the watermark): refused at once",
        tokens_policy(kv=100, watermark=0.05),
        [gw("huge", 0.1, prompts=(95,)), gw("ok", 0.2, prompts=(94,))],
        [],
        0.5,
        admit=["ok"],
        refuse=["huge"],
    ),
    Case(
        "never fits max_running even alone: refused at once",
        tokens_policy(max_running=2),
        [gw("wide", 0.1, prompts=(1, 1, 1)), gw("ok", 0.2)],
        [],
        0.5,
        admit=["ok"],
        refuse=["wide"],
    ),
    Case(
        "n > 1 whose sequences each fit but together never do: refused, not expired",
        tokens_policy(kv=100, watermark=0.05),
        [gw("n3", 0.1, prompts=(40, 40, 40)), gw("ok", 0.2, prompts=(40, 40))],
        [],
        0.5,
        admit=["ok"],  # 41 + 41 = 82 <= 95; n3's 123 > 95 whatever runs
        refuse=["n3"],
    ),
    Case(
        "never fits, deadline passed: expired (the deadline is checked first)",
        tokens_policy(kv=100),
        [gw("late", 0.1, deadline=0.4, prompts=(60, 60))],
        [],
        0.5,
        admit=[],
        expire=["late"],
    ),
    Case(
        "memory short: the lowest lane goes first, even if started earlier",
        tokens_policy(kv=100),
        [],
        [
            gr("l0", 3.0, contexts=(29,)),
            gr("l1", 2.0, lane=1, contexts=(29,)),
            gr("l2", 1.0, lane=2, contexts=(29,)),
            gr("l0b", 0.0, contexts=(19,)),
        ],
        5.0,
        admit=[],
        preempt=["l2"],
    ),
    Case(
        "memory short: within a lane, the latest started goes first, as many as needed",
        tokens_policy(kv=100),
        [],
        [
            gr("old", 1.0, lane=1, contexts=(39,)),
            gr("mid", 2.0, lane=1, contexts=(39,)),
            gr("new", 3.0, lane=1, contexts=(39,)),
            gr("top", 0.0, contexts=(39,)),
        ],
        5.0,
        admit=[],
        preempt=["new", "mid"],  # 160 → 120 → 80
    ),
    Case(
        "memory short with only lane 0 running: its latest started goes",
        tokens_policy(kv=100),
        [],
        [gr("a", 1.0, contexts=(59,)), gr("b", 2.0, contexts=(49,))],
        5.0,
        admit=[],
        preempt=["b"],
    ),
    Case(
        "memory short: nothing is admitted in a plan that preempts for growth (vLLM)",
        tokens_policy(kv=100),
        [gw("w", 4.0, prompts=(5,))],
        [gr("a", 1.0, contexts=(59,)), gr("b", 2.0, lane=1, contexts=(49,))],
        5.0,
        admit=[],  # b freed 50 and 60 + 6 would fit, but b would come back behind w
        preempt=["b"],
    ),
    Case(
        "lane 0 waiting, memory short: preempts the lowest lane, latest started, just enough",
        tokens_policy(kv=100),
        [gw("w", 4.0, prompts=(29,))],  # needs 30
        [
            gr("r0", 0.0, contexts=(29,)),
            gr("r1", 1.0, lane=1, contexts=(19,)),
            gr("r2a", 2.0, lane=2, contexts=(9,)),
            gr("r2b", 3.0, lane=2, contexts=(19,)),
        ],  # 30 + 20 + 10 + 20 = 80: 20 short
        5.0,
        admit=["w"],
        preempt=["r2b"],
    ),
    Case(
        "lane 0 waiting: lower lanes preempted only if it then fits",
        tokens_policy(kv=100),
        [gw("w", 4.0, prompts=(49,))],  # needs 50
        [gr("r0", 0.0, contexts=(59,)), gr("r2", 1.0, lane=2, contexts=(19,))],
        5.0,
        admit=[],  # freeing r2 leaves 60 + 50 > 100
    ),
    Case(
        "lane 0 waiting for a slot preempts a lower lane",
        tokens_policy(max_running=2),
        [gw("w", 4.0)],
        [gr("a", 1.0, lane=2), gr("b", 2.0, lane=1)],
        5.0,
        admit=["w"],
        preempt=["a"],
    ),
    Case(
        "a lower lane never preempts: lane 1 waits for lane 2's memory",
        tokens_policy(kv=100),
        [gw("w", 4.0, lane=1, prompts=(29,))],
        [gr("r0", 0.0, contexts=(49,)), gr("r2", 1.0, lane=2, contexts=(29,))],
        5.0,
        admit=[],
    ),
    Case(
        "lane 0 is never preempted for a lower lane",
        tokens_policy(kv=100),
        [gw("w", 0.0, lane=1, prompts=(9,))],
        [gr("a", 1.0, contexts=(49,)), gr("b", 2.0, contexts=(44,))],
        3.0,
        admit=[],
    ),
    Case(
        "a request admitted by starvation promotion is not preempted by lane 0",
        tokens_policy(kv=100, starvation_ms=1000),
        [gw("w", 4.0, prompts=(49,))],
        [gr("r0", 0.0, contexts=(49,)), gr("starved", 3.0, lane=2, arrived=1.0, contexts=(9,))],
        5.0,
        admit=[],
    ),
    Case(
        "once a promoted request waits past its bound, lane 0 on credit preempts one that"
        " starvation promotion admitted",
        tokens_policy(kv=100, starvation_ms=1000),
        [gw("w", 4.0, prompts=(49,)), gw("late", 0.0, lane=2, prompts=(9,))],
        [gr("r0", 0.0, contexts=(49,)), gr("starved", 3.0, lane=2, arrived=1.0, contexts=(9,))],
        5.0,
        admit=["w"],
        preempt=["starved"],
    ),
    Case(
        "but never one that was preempted before: lane 0 steps back, the promoted one goes",
        tokens_policy(kv=100, starvation_ms=1000),
        [gw("w", 4.0, prompts=(49,)), gw("late", 0.0, lane=2, prompts=(9,))],
        [
            gr("r0", 0.0, contexts=(49,)),
            gr("starved", 3.0, lane=2, arrived=1.0, contexts=(9,), preempted=1),
        ],
        5.0,
        admit=["late"],
    ),
    Case(
        "nor while promoted requests wait within their bound",
        tokens_policy(kv=100, starvation_ms=1000),
        [gw("w", 4.0, prompts=(49,)), gw("late", 4.1, lane=2, prompts=(9,))],
        [gr("r0", 0.0, contexts=(49,)), gr("starved", 3.0, lane=2, arrived=1.0, contexts=(9,))],
        5.0,
        admit=["late"],
    ),
    Case(
        "starvation: a lower lane past its promotion instant (bound less 25%) goes ahead of"
        " lane 0, after the one row lane 0's saved credit lets it go first",
        tokens_policy(max_running=3, starvation_ms=100),
        [gw("old", 0.0, lane=2)] + [gw(f"x{i}", 0.05 + i / 1000) for i in range(4)],
        [],
        0.076,
        admit=["x0", "old", "x1"],
    ),
    Case(
        "before its promotion instant it waits behind lane 0; wake at that instant",
        tokens_policy(max_running=2, starvation_ms=100),
        [gw("old", 0.0, lane=2), gw("x", 0.05), gw("y", 0.06), gw("z", 0.07)],
        [],
        0.07,
        admit=["x", "y"],
        wake_at=0.075,
    ),
    Case(
        "deadlines: waiting past theirs expire, running past theirs stop",
        tokens_policy(),
        [gw("late", 0.0, deadline=1.0), gw("ok", 0.1, deadline=2.0)],
        [gr("over", 0.0, deadline=0.9), gr("fine", 0.0, deadline=3.0)],
        1.0,
        admit=["ok"],
        stop=["over"],
        expire=["late"],
        wake_at=2.0,
    ),
    Case(
        "a running request that alone outgrew the cache stops",
        tokens_policy(kv=100),
        [],
        [gr("big", 0.0, contexts=(100,))],
        1.0,
        admit=[],
        stop=["big"],
    ),
    Case(
        "prefill backlog: admission waits while 4 steps' budgets of prompts queue ahead",
        tokens_policy(kv=10_000, step=100),
        [gw("a", 0.1, prompts=(100,)), gw("b", 0.2, prompts=(10,))],
        [gr("r", 0.0, contexts=(0,), prefill=(350,))],
        0.5,
        admit=[],  # 350 + 100 > 400, and b may not jump a
    ),
    Case(
        "prefill backlog: only higher and same lanes' prefill counts for a request",
        tokens_policy(kv=10_000, step=100),
        [gw("a", 0.1, prompts=(100,))],
        [gr("r", 0.0, lane=2, contexts=(0,), prefill=(350,))],
        0.5,
        admit=["a"],
    ),
    Case(
        "prefill backlog: a prompt over 4 steps' budgets goes alone when nothing prefills",
        tokens_policy(kv=10_000, step=100),
        [gw("long", 0.1, prompts=(900,)), gw("next", 0.2, prompts=(10,))],
        [gr("r", 0.0, contexts=(50,))],
        0.5,
        admit=["long"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule(case: Case) -> None:
    waiting = list(case.waiting)
    running = list(case.running)
    random.Random(0).shuffle(waiting)  # input order must not matter
    random.Random(1).shuffle(running)
    plan = GenerationPolicy(case.policy).plan(waiting, running, case.now)
    assert list(plan.admit) == case.admit
    assert list(plan.preempt) == (case.preempt or [])
    assert sorted(plan.stop) == sorted(case.stop or [])
    assert sorted(plan.expire) == sorted(case.expire or [])
    assert sorted(k for k, _ in plan.refuse) == sorted(case.refuse or [])
    if case.wake_at is not None:
        assert plan.wake_at == pytest.approx(case.wake_at)


def test_blocks_round_up_per_sequence() -> None:
    policy = GenerationPolicy(tokens_policy(kv=160, page=16))
    assert [policy.blocks(t) for t in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert blocks_for(5, 4) == 2


def test_schedule_step_decodes_first_then_prefill_by_lane() -> None:
    running = [
        gr("low", 0.0, lane=2, contexts=(0,), prefill=(300,)),
        gr("dec", 0.0, lane=1, contexts=(40, 41)),
        gr("top", 1.0, contexts=(0, 20), prefill=(50, 30)),
    ]
    chunks = schedule_step(running, 100)
    assert chunks == {"dec": (1, 1), "top": (50, 30), "low": (18,)}
    assert sum(sum(c) for c in chunks.values()) == 100
    assert step_blocks(running, chunks, 16) == 2 + 3 + 3 + 4 + 4


def test_set_policy_keeps_state_and_applies_new_caps() -> None:
    policy = GenerationPolicy(tokens_policy(max_running=4))
    running = [gr("a", 1.0, lane=1), gr("b", 2.0, lane=2), gr("c", 3.0)]
    assert policy.plan([], running, 5.0).preempt == ()
    policy.set_policy(tokens_policy(max_running=2))
    assert policy.plan([], running, 5.0).preempt == ("b",)


def test_wake_at_is_none_with_nothing_ahead() -> None:
    plan = GenerationPolicy(tokens_policy()).plan([], [gr("a")], 1.0)
    assert plan == type(plan)()


def test_lane0_goes_ahead_of_starving_lanes_only_on_credit() -> None:
    # One slot frees per plan; lane 2 is starving throughout; lane 0 always has one waiting.
    # Lane 0 earns w0/Σw = 4/5 of a row per admitted row and spends 1 per row it takes
    # ahead of a starving request: it cannot keep a starving lane out.
    policy = GenerationPolicy(tokens_policy(max_running=1, starvation_ms=100))
    taken = []
    for step in range(50):
        waiting = [gw(f"top{step}", 9.0 + step), gw(f"low{step}", 0.0, lane=2)]
        taken += policy.plan(waiting, [], 10.0 + step).admit
    low = sum(1 for k in taken if k.startswith("low"))
    assert len(taken) == 50
    assert 8 <= low <= 12  # its share, 1/5


def full_of_lower_lanes(now: float, victim: str) -> list[GenRunning]:
    """Two slots: a lane-2 request admitted before its promotion instant (lane 0 may
    preempt it) and a lane-1 one starvation promotion admitted (it may not)."""
    return [
        gr(victim, now - 0.01, lane=2, arrived=now - 0.01),
        gr("promoted", 0.5, lane=1, arrived=0.0),
    ]


def test_lane0_without_credit_goes_behind_a_stuck_promoted_request_by_freeing_its_room() -> None:
    # Slots full; a starving lane-2 request heads the line and cannot fit (only lane 0
    # preempts). Lane 0 keeps arriving: past its credit it still goes, each time by
    # preempting what it takes, and the starving request keeps waiting for a slot that
    # frees by itself (the lane-0 request took none that could have been its).
    policy = GenerationPolicy(tokens_policy(max_running=2, starvation_ms=100))
    for step in range(6):
        now = 1.0 + step
        waiting = [gw("old", 0.0, lane=2), gw(f"top{step}", now - 0.001)]
        plan = policy.plan(waiting, full_of_lower_lanes(now, f"v{step}"), now)
        assert plan.admit == (f"top{step}",)
        assert plan.preempt == (f"v{step}",)


def test_lane0_without_credit_waits_when_freeing_would_not_cover_what_it_takes() -> None:
    policy = GenerationPolicy(tokens_policy(kv=100, max_running=4, starvation_ms=100))
    for step in range(6):
        now = 1.0 + step
        waiting = [
            gw("old", 0.0, lane=2, prompts=(49,)),
            gw(f"top{step}", now - 0.001, prompts=(19,)),
        ]
        # 70 + 11 reserved: "old" needs 50 (does not fit); freeing the victim gives 11 < 20
        running = [gr("promoted", 0.5, lane=1, arrived=0.0, contexts=(69,)),
                   gr(f"v{step}", now - 0.01, lane=2, arrived=now - 0.01, contexts=(10,))]  # fmt: skip
        plan = policy.plan(waiting, running, now)
        if not plan.admit:
            break
        assert plan.admit == (f"top{step}",)  # on credit (it preempts just enough)
    else:
        raise AssertionError("lane 0 went ahead past its credit without freeing its room")
    assert plan.preempt == ()


def test_lane0_preempts_promoted_requests_only_on_credit() -> None:
    # Lower lanes past their bound: a lane-2 request waits that never fits, and each plan
    # a fresh promoted lane-1 request runs. Lane 0 arrives each time and needs its room:
    # it preempts the promoted request while its credit lasts (1.5 rows, earning 4/5 of
    # a row per row it admits), then waits for room to free by itself.
    policy = GenerationPolicy(tokens_policy(kv=100, max_running=4, starvation_ms=100))
    took = []
    for step in range(8):
        now = 1.0 + step
        waiting = [gw(f"top{step}", now - 0.001, prompts=(49,)),
                   gw("huge", 0.0, lane=2, prompts=(89,))]  # fmt: skip
        running = [gr("r0", 0.0, contexts=(49,)),
                   gr(f"p{step}", 0.5, lane=1, arrived=0.0, contexts=(9,))]  # fmt: skip
        plan = policy.plan(waiting, running, now)
        if plan.admit:
            assert plan.admit == (f"top{step}",) and plan.preempt == (f"p{step}",)
        took.append(bool(plan.admit))
    assert took == [True, True, True] + [False] * 5


def test_starvation_credit_is_metered_by_lane_weight() -> None:
    # Lane 0 floods (always 20 waiting), lane 2 floods too and is always starving:
    # over many plans lane 2 gets about its weighted share w2/Σw of admissions, not more.
    policy = GenerationPolicy(tokens_policy(max_running=4, starvation_ms=100))
    admitted = {0: 0, 2: 0}
    t = 10.0
    for step in range(200):
        waiting = [gw(f"a{step}-{i}", t - 0.001 * i) for i in range(20)]
        waiting += [gw(f"c{step}-{i}", 0.0, lane=2) for i in range(20)]
        plan = policy.plan(waiting, [], t)
        for key in plan.admit:
            admitted[0 if key.startswith("a") else 2] += 1
        t += 0.01
    assert admitted[0] + admitted[2] == 800
    share = admitted[2] / 800
    assert 0.15 <= share <= 0.35  # w2/Σw over lanes 0 and 2 = 1/5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 0},
        {"kv_cache_tokens": 8, "page_size": 16},
        {"step_tokens": 16, "max_running": 16},
        {"watermark": 1.0},
        {"max_starvation_ms": -1.0},
    ],
)
def test_policy_validation(kwargs: dict[str, float]) -> None:
    base: dict[str, float] = {
        "kv_cache_tokens": 1024,
        "page_size": 16,
        "step_tokens": 256,
        "max_running": 8,
    }
    with pytest.raises(ValueError):
        GenPolicy(**{**base, **kwargs})  # type: ignore[arg-type]


def test_prefill_steps_is_four() -> None:
    # The cases above are written for 4 steps of budget; change them with the constant.
    assert PREFILL_STEPS == 4


@pytest.mark.parametrize(
    ("policy", "prompts", "words"),
    [
        (tokens_policy(kv=100, watermark=0.05), (40, 40, 40),
         ["its 3 sequences together need 123 KV cache blocks", "over the 95 of 100"]),
        (tokens_policy(kv=100, watermark=0.05), (95,), ["its sequence needs 96 KV cache blocks"]),
        (tokens_policy(max_running=2), (1, 1, 1), ["3 slots", "max_running 2"]),
    ],
)  # fmt: skip
def test_refusal_says_what_never_fits(
    policy: GenPolicy, prompts: tuple[int, ...], words: list[str]
) -> None:
    plan = GenerationPolicy(policy).plan([gw("big", 0.1, prompts=prompts)], [], 0.5)
    ((key, why),) = plan.refuse
    assert key == "big" and all(w in why for w in words), why


def test_wake_at_is_the_next_instant_strictly_after_now() -> None:
    # No slot frees (lane 0 runs in the only one): neither lower-lane request is admitted.
    # One is promoted right now; the plan wakes for the other's promotion, or a deadline.
    policy = GenerationPolicy(tokens_policy(max_running=1, starvation_ms=1000))
    waiting = [gw("due", 0.25, lane=1), gw("later", 0.5, lane=2)]
    plan = policy.plan(waiting, [gr("a", 0.0)], 1.0)  # promote_after 0.75: at 1.0 and 1.25
    assert plan.admit == () and plan.wake_at == 1.25
    far = [*waiting, gw("far", 0.95, lane=1, deadline=1.5)]
    assert policy.plan(far, [gr("a", 0.0)], 1.0).wake_at == 1.25
    soon = [*far, gw("dl", 0.9, lane=1, deadline=1.1)]
    assert policy.plan(soon, [gr("a", 0.0)], 1.0).wake_at == 1.1
