"""What the generating loop keeps from step to step instead of recomputing each time round
(``bench/loop_cpu.py`` measures what each saves), checked against the recomputed value
over random runs in virtual time: lanes competing for a small cache (preemption, lane 0
going ahead), cancellations, deadlines, requests lost to other workers, planned in turn
and ahead."""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Any

import pytest
from batchfleet.batching.gen_types import GenWaiting
from batchfleet.schemas.messages import Request
from batchfleet.worker.gen_scheduler import GenScheduler
from batchfleet.worker.inbox import Cancel, Lost
from batchfleet.worker.token_gaps import ITL_BUCKETS, TokenGaps
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram
from test_generation_loop import Tokens, gen_rig
from virtual_world import MODEL, T0

GAPS = (0.0004, 0.001, 0.0123, 0.0123, 0.05, 0.2, 7.0)
"""Gaps a step closes: mostly the same few, on bucket bounds and past the last."""


class Watcher:
    """The cancel watcher's side: the last set of request ids it was told to watch."""

    def __init__(self) -> None:
        self.ids: frozenset[str] | None = None
        self.told = 0

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def watch(self, request_ids: Collection[str]) -> None:
        self.ids = frozenset(request_ids)
        self.told += 1


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "ahead"])
@pytest.mark.parametrize("seed", range(10))
def test_the_cancel_watcher_always_holds_every_request_waiting_or_running(
    seed: int, ahead: bool
) -> None:
    # Given a random run: arrivals on every lane, cancels, deadlines, lost requests
    rng = random.Random(seed)
    runner = Tokens(kv_cache_tokens=256, page_size=16, max_running=6, step_tokens=64,
                    schedule_ahead=ahead)  # fmt: skip
    r, _ = gen_rig(runner)
    watcher = Watcher()
    r.loop.parts.cancels = watcher
    entries = []
    for k in range(30):
        extra: dict[str, Any] = {"stream": rng.random() < 0.5}
        if rng.random() < 0.15:
            extra["deadline_ms"] = rng.randint(20, 400)
        req = Request(id=f"q{k}", model=MODEL, inputs=["w " * rng.randint(1, 40)],
                      max_new_tokens=rng.randint(1, 25), **extra)  # fmt: skip
        entries.append(r.source.add(req, lane=rng.choice((0, 1, 2)), at=T0 + rng.uniform(0, 0.5)))
        if rng.random() < 0.15:
            when, rid = T0 + rng.uniform(0, 0.8), req.id
            r.world.at(when, lambda rid=rid: r.loop.parts.inbox.put(Cancel((rid,))))
    for entry in rng.sample(entries, 3):
        r.world.at(T0 + rng.uniform(0.05, 0.8),
                   lambda entry=entry: r.loop.parts.inbox.put(Lost((entry,))))  # fmt: skip
    # When the loop tells the watcher (or not) each time round, then Then after each time:
    # it watches exactly the requests held, waiting or running (recomputed)
    checked = []
    watch = r.loop.generating.watch

    def checked_watch() -> None:
        watch()
        sched = r.loop.scheduler
        assert isinstance(sched, GenScheduler)
        assert watcher.ids == {h.request.id for h in sched.watched()}
        checked.append(len(watcher.ids))

    r.loop.generating.watch = checked_watch  # type: ignore[method-assign]
    # and the policy's view of each waiting request (kept from step to step) is as made anew
    sched = r.loop.scheduler
    assert isinstance(sched, GenScheduler)
    plan = sched.policy.plan
    resumed = []

    def checked_plan(waiting: Sequence[GenWaiting], running: Any, now: float) -> Any:
        for w in waiting:
            h, res = sched.held[w.key], sched._resume.get(w.key)
            p = h.prepared
            prompts, left = (
                (res.prompts, res.max_new_tokens) if res else (p.prompts, p.max_new_tokens)
            )
            assert w == GenWaiting(w.key, h.waiting.lane, h.waiting.arrived, h.waiting.deadline,
                                   prompts, left)  # fmt: skip
            resumed.append(res is not None)
        return plan(waiting, running, now)

    sched.policy.plan = checked_plan  # type: ignore[method-assign]
    r.run()
    assert len(checked) > 30 and max(checked) > 6  # requests waited as others ran
    assert watcher.told < len(checked)  # and it was not told every time round
    assert any(resumed)  # preempted ones waited again


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(GAPS)), max_size=40),
                      max_size=6))  # fmt: skip
def test_token_gaps_counted_a_step_at_a_time_equal_a_histogram_observed_per_gap(
    steps: list[list[tuple[int, float]]],
) -> None:
    # Given a step's gaps counted before they are labelled (add: by lane; add_to: one series)
    gaps, one = TokenGaps(), TokenGaps("one_seconds", "x", labels=("model", "engine"))
    registry = CollectorRegistry()
    per_gap = Histogram("ref_seconds", "x", ["model", "lane"], buckets=ITL_BUCKETS,
                        registry=registry)  # fmt: skip
    per_series = Histogram("ref1_seconds", "x", ["model", "engine"], buckets=ITL_BUCKETS,
                           registry=registry)  # fmt: skip
    for step in steps:
        gaps.add("m", step)
        one.add_to(("m", "0"), step)
        for lane, seconds in step:  # the reference: each gap observed alone
            per_gap.labels("m", str(lane)).observe(seconds)
            per_series.labels("m", "0").observe(seconds)
    # Then every bucket, count and sum is the reference's
    assert _samples(gaps, "batchfleet_inter_token_latency_seconds") == _samples(
        per_gap, "ref_seconds"
    )
    assert _samples(one, "one_seconds") == _samples(per_series, "ref1_seconds")


def _samples(collector: Any, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A histogram's samples by suffix and labels (sums rounded: summed in another order)."""
    out = {}
    for family in collector.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[s.name.removeprefix(name), tuple(sorted(s.labels.items()))] = round(s.value, 9)
    return out
