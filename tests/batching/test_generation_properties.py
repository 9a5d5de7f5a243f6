"""Hypothesis properties of the generation policy over random states, and of its simulator."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

import pytest
from batchfleet.batching import gen_admission
from batchfleet.batching.gen_blocks import (
    admission_blocks,
    reserved_blocks,
    schedule_step,
    step_blocks,
)
from batchfleet.batching.gen_simulator import StepCost, gen_poisson, simulate_generation
from batchfleet.batching.gen_types import GenPolicy, GenRunning, GenWaiting
from batchfleet.batching.generation import GenerationPolicy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


@st.composite
def policies(draw: st.DrawFn) -> GenPolicy:
    page = draw(st.sampled_from([1, 4, 16, 32]))
    blocks = draw(st.integers(4, 200))
    max_running = draw(st.integers(1, 16))
    return GenPolicy(
        kv_cache_tokens=blocks * page + draw(st.integers(0, page - 1)),
        page_size=page,
        step_tokens=max_running + draw(st.integers(1, 512)),
        max_running=max_running,
        watermark=draw(st.sampled_from([0.0, 0.01, 0.1])),
        max_starvation_ms=draw(st.sampled_from([50.0, 500.0, 2000.0])),
    )


lanes = st.integers(0, 2)
times = st.floats(0.0, 10.0)
deadlines = st.one_of(st.none(), st.floats(0.0, 12.0))


@st.composite
def waitings(draw: st.DrawFn) -> list[GenWaiting]:
    n = draw(st.integers(0, 10))
    return [
        GenWaiting(
            f"w{i}",
            draw(lanes),
            draw(times),
            draw(deadlines),
            tuple(draw(st.lists(st.integers(1, 400), min_size=1, max_size=3))),
            draw(st.integers(1, 256)),
        )
        for i in range(n)
    ]


@st.composite
def runnings(draw: st.DrawFn) -> list[GenRunning]:
    n = draw(st.integers(0, 10))
    out = []
    for i in range(n):
        k = draw(st.integers(1, 3))
        arrived = draw(times)
        out.append(
            GenRunning(
                f"r{i}",
                draw(lanes),
                arrived,
                draw(deadlines),
                arrived + draw(st.floats(0.0, 3.0)),
                tuple(draw(st.lists(st.integers(0, 300), min_size=k, max_size=k))),
                tuple(draw(st.lists(st.sampled_from([0, 0, 5, 100]), min_size=k, max_size=k))),
                draw(st.integers(0, 256)),
                draw(st.sampled_from([0, 0, 1])),
                tuple(range(k)) if draw(st.booleans()) else (),  # its sequences apart, or whole
            )
        )
    return out


@st.composite
def children(draw: st.DrawFn, running: list[GenRunning]) -> list[GenWaiting]:
    """Sequences of running requests that name theirs, preempted alone and waiting."""
    out = []
    for r in running:
        if r.seqs:
            for i in range(draw(st.integers(0, 2))):
                seq = len(r.seqs) + i
                prompt = draw(st.integers(1, 400))
                out.append(GenWaiting(f"{r.key}#{seq}", r.lane, r.arrived_at, r.deadline,
                                      (prompt,), draw(st.integers(1, 256)), parent=r.key))  # fmt: skip
    return out


def _without(r: GenRunning, seqs: tuple[int, ...]) -> GenRunning:
    """A running request less its sequences ``seqs`` (preempted alone)."""
    keep = [j for j, s in enumerate(r.seqs) if s not in seqs] if seqs else range(len(r.contexts))
    contexts = tuple(r.contexts[j] for j in keep)
    prefill = tuple(r.prefill_left[j] for j in keep)
    return replace(
        r,
        contexts=contexts,
        prefill_left=prefill,
        seqs=tuple(r.seqs[j] for j in keep) if r.seqs else (),
    )


def _as_running(w: GenWaiting, now: float) -> GenRunning:
    zeros = (0,) * len(w.prompts)
    return GenRunning(w.key, w.lane, w.arrived_at, w.deadline, now, zeros, w.prompts, 1)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies(), waiting=waitings(), running=runnings(), now=st.floats(0.0, 13.0),
       data=st.data())  # fmt: skip
def test_plan_keeps_budgets_keys_and_rules(
    policy: GenPolicy,
    waiting: list[GenWaiting],
    running: list[GenRunning],
    now: float,
    data: st.DataObject,
) -> None:
    waiting = waiting + data.draw(children(running))
    plan = GenerationPolicy(policy).plan(waiting, running, now)
    parts = dict(plan.preempt_seqs)
    refused = dict(plan.refuse)
    keys = [*plan.admit, *plan.preempt, *plan.stop, *plan.expire, *refused, *parts]
    # Disjoint, and only known keys, each from the right side.
    assert len(keys) == len(set(keys)) and len(parts) == len(plan.preempt_seqs)
    assert len(refused) == len(plan.refuse)
    w_keys = {w.key for w in waiting}
    r_keys = {r.key for r in running}
    assert set(plan.admit) | set(plan.expire) | set(refused) <= w_keys
    assert set(plan.preempt) | set(plan.stop) | set(parts) <= r_keys
    by_run = {r.key: r for r in running}
    for key, seqs in parts.items():  # some or all of its sequences, one at a time
        assert seqs and set(seqs) <= set(by_run[key].seqs)
    for key in plan.preempt:  # whole: only a request that names no sequences
        assert not by_run[key].seqs
    # A preempted sequence resumes only into a request that runs on, whole.
    for w in waiting:
        if w.key in plan.admit and w.parent is not None:
            assert w.parent not in {*plan.stop, *plan.preempt, *parts}
    # Deadlines.
    for w in waiting:
        if w.parent is not None and w.parent in plan.stop:  # it ends with its request
            assert w.key not in plan.expire and w.key not in plan.admit
        elif w.deadline is not None and w.deadline <= now:
            assert w.key in plan.expire
        else:  # refused exactly when it can never fit, even alone, whatever runs
            never = len(w.prompts) > policy.max_running or admission_blocks(w, policy.page_size) > (
                policy.total_blocks - policy.watermark_blocks
            )
            assert (w.key in refused) == never
    for r in running:
        if r.deadline is not None and r.deadline <= now:
            assert r.key in plan.stop
    # Budgets of the next step after applying the plan.
    gone = set(plan.preempt) | set(plan.stop)
    kept = [_without(r, parts.get(r.key, ())) for r in running if r.key not in gone]
    by_key = {w.key: w for w in waiting}
    batch = kept + [_as_running(by_key[k], now) for k in plan.admit]
    chunks = schedule_step(batch, policy.step_tokens)
    assert sum(sum(c) for c in chunks.values()) <= policy.step_tokens
    assert step_blocks(batch, chunks, policy.page_size) <= policy.total_blocks
    assert sum(reserved_blocks(r, policy.page_size) for r in batch) <= policy.total_blocks
    assert sum(len(r.contexts) for r in batch) <= policy.max_running
    if plan.admit:  # admission leaves the watermark free
        room = policy.total_blocks - policy.watermark_blocks
        assert sum(reserved_blocks(r, policy.page_size) for r in batch) <= room
    # Lane 0 is never preempted while a lower lane keeps running or is admitted.
    lanes_of = {r.key: r.lane for r in running} | {w.key: w.lane for w in waiting}
    preempted = [*plan.preempt, *parts]
    if any(lanes_of[k] == 0 for k in preempted):
        assert all(r.lane == 0 for r in kept if r.contexts)
        assert all(lanes_of[k] == 0 for k in plan.admit)
    # A preemption in a plan that admits is lane 0's, of lower lanes (what room is left
    # after lane 0 fits may go to the next in line).
    if preempted and plan.admit:
        assert any(lanes_of[k] == 0 for k in plan.admit)
        assert all(lanes_of[k] > 0 for k in preempted)
    assert plan.wake_at is None or plan.wake_at > now


POLICY = GenPolicy(kv_cache_tokens=16384, page_size=16, step_tokens=512, max_running=32)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a lane-0 arrival once preempted the request a waiting child of it resumed into, in one plan
@example(rate=60.0, kv=16384, deadlines=False, shape=((1, 2), (2, 2)), seed=348)
@given(
    rate=st.sampled_from([2.0, 20.0, 60.0, 150.0]),
    kv=st.sampled_from([2048, 4096, 16384]),
    deadlines=st.booleans(),
    # inputs per request, ``n`` per input: up to eight sequences of 200 + 256 tokens fit
    shape=st.sampled_from([((1, 1), (1, 1)), ((1, 3), (1, 1)), ((1, 1), (2, 4)), ((1, 2), (2, 2))]),
    seed=st.integers(0, 2**16),
)
def test_simulator_every_request_ends_once_within_budgets(
    rate: float,
    kv: int,
    deadlines: bool,
    shape: tuple[tuple[int, int], tuple[int, int]],
    seed: int,
) -> None:
    inputs, completions = shape
    trace = gen_poisson(
        150,
        rate,
        inputs=inputs,
        prompt=(8, 512) if completions == (1, 1) else (8, 200),
        completions=completions,
        deadline_s=(0.05, 3.0) if deadlines else None,
        seed=seed,
    )
    policy = GenPolicy(kv_cache_tokens=kv, page_size=16, step_tokens=512, max_running=32)
    report = simulate_generation(trace, policy)
    assert report.violations == ()
    assert report.finished + report.stopped + report.expired + report.refused == len(trace)
    assert report.max_step_tokens <= policy.step_tokens
    assert report.max_step_blocks <= policy.total_blocks
    assert report.max_running <= policy.max_running
    if not deadlines:
        assert report.finished == len(trace)


@pytest.mark.parametrize("lane0_rate", [70.0, 100.0])
def test_simulator_a_lane_within_its_share_waits_at_most_its_bound(lane0_rate: float) -> None:
    # Lane 0 floods past the device (about 45 requests/s here); lane 2 asks about 5% of
    # the device, under its 1/5 share: it still gets in within max_starvation_ms.
    flood = gen_poisson(int(lane0_rate * 10), lane0_rate, lanes=(1.0,), seed=1)
    light = gen_poisson(40, 4.0, lanes=(0.0, 0.0, 1.0), prefix="z", seed=2)
    report = simulate_generation(sorted(flood + light, key=lambda r: r.arrived), POLICY)
    assert report.violations == ()
    assert report.lane(2).wait_max <= POLICY.max_starvation_ms / 1000.0
    assert report.lane(0).wait_max > POLICY.max_starvation_ms / 1000.0  # it was saturated


def test_simulator_lane0_ttft_at_saturation_within_3x_unloaded() -> None:
    # Saturation: 60 requests/s over lanes 20/30/50% against about 45/s of capacity.
    unloaded = simulate_generation(gen_poisson(300, 0.5, seed=1), POLICY)
    loaded = simulate_generation(gen_poisson(1200, 60.0, seed=1), POLICY)
    assert loaded.violations == ()
    assert loaded.lane(2).wait_max > 2 * POLICY.max_starvation_ms / 1000.0  # overloaded
    assert loaded.lane(0).ttft_p99 <= 3 * unloaded.lane(0).ttft_p99


def test_simulator_reproducible_and_costed() -> None:
    trace = gen_poisson(200, 30.0, seed=5)
    first = simulate_generation(trace, POLICY, StepCost(a=0.01))
    assert first == simulate_generation(trace, POLICY, StepCost(a=0.01))
    assert first.duration > simulate_generation(trace, POLICY, StepCost(a=0.001)).duration


def test_simulator_preempts_when_memory_is_short() -> None:
    report = simulate_generation(
        gen_poisson(400, 60.0, seed=3),
        GenPolicy(kv_cache_tokens=2048, page_size=16, step_tokens=512, max_running=32),
    )
    assert report.violations == ()
    assert report.preemptions > 0
    assert report.finished == 400


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies(), waiting=waitings(), running=runnings(), now=st.floats(0.0, 13.0),
       full=st.booleans(), empty=st.booleans(), rounds=st.integers(1, 3))  # fmt: skip
def test_a_plan_with_every_slot_taken_matches_the_full_ordering(
    policy: GenPolicy, waiting: list[GenWaiting], running: list[GenRunning], now: float,
    full: bool, empty: bool, rounds: int,
) -> None:  # fmt: skip
    """The shortcut for a step with every slot taken (``_slots_full``) admits no one and
    spends no credit, as ordering every candidate would find: plans (repeated, so the
    lanes' credit has moved) equal to a policy's that always orders them."""
    if empty:  # a request of no sequences takes no slot (its runner answers it at once)
        waiting = [*waiting, GenWaiting("empty", 2, now, None, (), 4)]
    seqs = sum(len(r.contexts) for r in running)
    if full and seqs:  # every slot taken (else: as drawn)
        policy = replace(policy, max_running=seqs, step_tokens=max(policy.step_tokens, seqs + 1))
    fast, slow = GenerationPolicy(policy), GenerationPolicy(policy)
    for k in range(rounds):
        at = now + k * 0.5
        with patch.object(gen_admission, "_slots_full", lambda *_: False):
            expected = slow.plan(waiting, running, at)
        assert fast.plan(waiting, running, at) == expected
        assert fast.credit() == slow.credit()
