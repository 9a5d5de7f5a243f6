"""The batching engine: a pure function of what is waiting, the clock and what it learnt.

The worker calls :meth:`Engine.plan` whenever something arrives, the device frees up
or a returned ``wake_at`` passes, and reports back measured batch times
(:meth:`Engine.observe`) and out-of-memory failures (:meth:`Engine.out_of_memory`).
The rules live in one module each: ``costmodel`` (batch time fit, best batch size), ``rates``
(arrival rates), ``lanes`` (priority and starvation), ``grouping`` (caps, deadlines,
length, batch size), ``window`` (when to dispatch), ``memory`` (OOM back-off).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .costmodel import CostModel
from .grouping import compose
from .lanes import LaneScheduler, group_by_lane
from .memory import MemoryGuard
from .rates import ArrivalRates
from .types import Batch, Plan, Policy, Waiting
from .window import decide

SAFETY = 1e-6
"""Seconds of margin so a deadline decision never lands on the wrong side of a float."""
STARVATION_LOOKAHEAD = 2.0
"""Batch times ahead at which a request nearing its starvation bound is promoted."""
READ_AHEAD_BATCHES = 3
"""The worker holds about this many batches beyond the running one: the next, and two to
choose from for length grouping (2 leaves too little choice); not enough to hoard."""


class Engine:
    """Decides which waiting requests form the next micro-batch, and when it leaves."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._cost = CostModel()
        self._rates = ArrivalRates()
        self._lanes = LaneScheduler()
        self._memory = MemoryGuard()

    def set_policy(self, policy: Policy) -> None:
        """Swap the knobs live; the learnt cost, rates and memory caps are kept."""
        self.policy = policy

    def estimate(self, rows: int, padded_tokens: int) -> float:
        """Predicted seconds for a batch of ``rows`` rows and ``padded_tokens`` tokens."""
        return self._cost.estimate(rows, padded_tokens)

    def observe(self, batch: Batch, seconds: float) -> None:
        """Learn from the measured run time of a dispatched batch."""
        self._cost.observe(batch.rows, batch.padded_tokens, seconds)

    def out_of_memory(self, batch: Batch, now: float) -> None:
        """That batch ran out of device memory: lower the caps, probe back up later."""
        self._memory.out_of_memory(batch, now, self.policy)

    def read_budget(self, held: int) -> int:
        """How many more requests to read now, holding ``held`` (never 0 when holding none)."""
        target = READ_AHEAD_BATCHES * self._memory.row_cap(self.policy)
        return max(target - held, 1 if held <= 0 else 0)

    def plan(self, waiting: Sequence[Waiting], now: float, busy_until: float | None = None) -> Plan:
        """The next batch to run now, the requests to answer ``expired``, and when to call again.

        ``busy_until`` None: the device is idle. Otherwise it is busy until about then:
        no batch is returned, and expiry counts from the time the device frees up.
        """
        policy = self.policy
        self._rates.learn(waiting)
        self._memory.tick(now, policy)
        estimate = self._cost.estimator()
        start = now if busy_until is None else max(now, busy_until)

        alive: list[Waiting] = []
        expired: list[Waiting] = []
        expiry: dict[str, float] = {}
        max_tok = 0
        for w in waiting:
            if w.deadline is not None:
                alone = estimate(w.size, w.size * w.tokens)
                if start + alone > w.deadline:
                    expired.append(w)
                    continue
                expiry[w.key] = w.deadline - alone + SAFETY
            alive.append(w)
            if w.tokens > max_tok:
                max_tok = w.tokens
        if not alive:
            return Plan(expired=tuple(expired))
        if busy_until is not None:
            wake = _earliest(busy_until if busy_until > now else None, *expiry.values())
            return Plan(expired=tuple(expired), wake_at=wake)

        row_cap = self._memory.row_cap(policy)
        token_cap = self._memory.token_cap(policy)
        full_tokens = row_cap * max_tok
        if token_cap is not None:
            full_tokens = min(full_tokens, token_cap)
        # Promote one batch early (two batch times ahead): a starving lane whose share is
        # under one row per batch then still makes its bound when two requests coincide.
        horizon = STARVATION_LOOKAHEAD * estimate(row_cap, full_tokens)

        by_lane = group_by_lane(alive)
        promoted, rest = self._lanes.order(by_lane, now, horizon, row_cap, policy)
        cost = self._cost
        comp = compose(
            promoted + rest,
            row_cap=row_cap,
            token_cap=token_cap,
            start=now,
            estimate=estimate,
            row_cost=(lambda t: cost.row_cost(t, row_cap, token_cap))
            if cost.padding_costs
            else None,
            best_rows=lambda t: cost.best_rows(t, row_cap, token_cap),
            fixed=len(promoted),
        )
        items = comp.items
        if not items:  # every one is blocked by a deadline it can only meet alone later
            return Plan(expired=tuple(expired), wake_at=_earliest(*expiry.values()))

        latest_start = None
        if comp.min_deadline != math.inf:
            padded = comp.rows * comp.max_tokens
            latest_start = comp.min_deadline - estimate(comp.rows, padded) - SAFETY
        decision = decide(
            now=now,
            rows=comp.rows,
            full=comp.full,
            oldest=min(w.arrived for w in items),
            latest_start=latest_start,
            starve_at=self._lanes.starving_at(by_lane, horizon, policy),
            policy=policy,
            rate=self._rates.rate(now),
            overhead=self._cost.overhead,
        )
        if decision.reason is None:
            wake = _earliest(decision.wake_at, *expiry.values())
            if wake is not None and wake <= now:
                wake = now + SAFETY
            return Plan(expired=tuple(expired), wake_at=wake)

        items = _trim_to_preferred(items, policy.preferred_batch_sizes)
        promoted_keys = {w.key for w in promoted}
        promoted_rows: dict[int, int] = {}
        for w in items:
            if w.key in promoted_keys:
                promoted_rows[w.lane] = promoted_rows.get(w.lane, 0) + w.size
        self._lanes.commit(by_lane, promoted_rows, row_cap, policy, sum(w.size for w in items))
        # "starvation" when a promotion decided who went (with room, all would have).
        reason = "starvation" if promoted_rows and comp.full else decision.reason
        batch = Batch(tuple(items), reason)
        taken = {w.key for w in items}
        wake = _earliest(*(t for k, t in expiry.items() if k not in taken))
        return Plan(batch=batch, expired=tuple(expired), wake_at=wake)


def _trim_to_preferred(items: list[Waiting], preferred: tuple[int, ...]) -> list[Waiting]:
    """Cut a batch down to the largest preferred size it exceeds (lowest priority goes)."""
    if not preferred:
        return items
    rows = sum(w.size for w in items)
    fitting = [p for p in preferred if p <= rows]
    if not fitting or rows in preferred:
        return items
    target = max(fitting)
    kept: list[Waiting] = []
    total = 0
    for w in items:
        if total + w.size <= target or not kept:
            kept.append(w)
            total += w.size
    return kept


def _earliest(*times: float | None) -> float | None:
    present = [t for t in times if t is not None]
    return min(present) if present else None
