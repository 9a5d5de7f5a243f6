"""Priority lanes with bounded starvation: strict priority, starvation deadlines, DRR quotas.

Why this and not plain aging or plain weighted round robin:

* Strict priority alone (Triton's priority levels, vLLM's priority policy) lets a
  saturated top lane starve the others forever.
* Weighted deficit round robin alone gives every backlogged lane its share of every
  batch, so a lane-0 request waits behind lane-2 work even when nothing is starving:
  higher lanes would no longer simply go first.
* Aging alone (raising a request's priority with its wait) bounds every wait, but a
  flooded low lane then ages en masse to the top and takes the device from lane 0.

So each request gets a *starvation deadline* ``arrived + max_starvation_ms``. Batches
are filled in strict lane order, oldest first within a lane, except that requests of
lower lanes whose starvation deadline falls before the next dispatch opportunity
(``now + horizon``, one batch time) are *promoted* to the front. Promotions are metered
by weighted deficit round robin over ``lane_weights``: a lane may promote its weighted
share of each batch's rows: credit accrues by that share of each dispatched batch, up to
:data:`BURST_BATCHES` batches' worth, and promotions spend it (rounded up, so a share
under one row still gets its row at once and pays it back later). Hence:

* with headroom nobody is promoted: strict priority, oldest first;
* a lower lane whose load fits its share waits at most ``max_starvation_ms`` (it is
  promoted at the last dispatch before its bound);
* lane 0 keeps at least ``w0 / Σw`` of the rows (over a few batches) while it is
  backlogged, however flooded the lower lanes are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .types import Policy, Waiting

BURST_BATCHES = 4
"""A lane's unused promotion credit is kept up to this many batches' worth."""


def lane_weight(policy: Policy, lane: int) -> float:
    """Weight of ``lane`` (lanes past the configured weights take the last one)."""
    weights = policy.lane_weights
    if not weights:
        return 1.0
    return max(weights[min(lane, len(weights) - 1)], 1e-9)


class LaneScheduler:
    """Orders waiting requests for the next batch and meters starvation promotions."""

    def __init__(self) -> None:
        self._deficit: dict[int, float] = {}

    def order(
        self,
        by_lane: dict[int, list[Waiting]],
        now: float,
        horizon: float,
        row_cap: int,
        policy: Policy,
    ) -> tuple[list[Waiting], list[Waiting]]:
        """Split waiting requests into ``(promoted, rest)``, each in the order to take them.

        ``by_lane`` maps lane to its requests, oldest first. ``promoted`` are starving
        requests of lower lanes (oldest first, within their lanes' quotas); ``rest``
        is everything else in lane order, oldest first.
        """
        cutoff = now + horizon - policy.max_starvation_ms / 1000.0
        lanes = sorted(by_lane)
        total = sum(lane_weight(policy, lane) for lane in lanes)
        promoted: list[Waiting] = []
        rest: list[Waiting] = []
        for lane in lanes:
            items = by_lane[lane]
            if lane == lanes[0] or items[0].arrived > cutoff:
                rest.extend(items)
                continue
            share = row_cap * lane_weight(policy, lane) / total
            # Round up and carry the debt: a share under one row still gets its row now.
            allowance = math.ceil(self._deficit.get(lane, _burst(share)) - 1e-9)
            taken = 0
            rows = 0
            for w in items:
                if w.arrived > cutoff or allowance <= 0:
                    break
                if rows and rows + w.size > allowance:
                    break
                rows += w.size
                taken += 1
            promoted.extend(items[:taken])
            rest.extend(items[taken:])
        if len(promoted) > 1:
            promoted.sort(key=lambda w: w.arrived)
        return promoted, rest

    def commit(
        self,
        by_lane: dict[int, list[Waiting]],
        promoted_rows: dict[int, int],
        row_cap: int,
        policy: Policy,
        rows: int | None = None,
    ) -> None:
        """Charge a dispatched batch's promotions to the lanes' credit; accrue their shares.

        A lane's share accrues from the ``rows`` the batch holds (default: a full batch),
        so batches cut short for throughput do not hand lower lanes more than their share.
        """
        lanes = sorted(by_lane)
        total = sum(lane_weight(policy, lane) for lane in lanes)
        dispatched = row_cap if rows is None else min(rows, row_cap)
        deficit = self._deficit
        for lane in lanes[1:]:
            weight = lane_weight(policy, lane) / total
            burst = _burst(row_cap * weight)
            left = deficit.get(lane, burst) - promoted_rows.get(lane, 0) + dispatched * weight
            deficit[lane] = min(left, burst)

    @staticmethod
    def starving_at(
        by_lane: dict[int, list[Waiting]], horizon: float, policy: Policy
    ) -> float | None:
        """Earliest time a lower-lane request would need promotion (None: no lower lanes)."""
        lanes = sorted(by_lane)
        bound = policy.max_starvation_ms / 1000.0
        times = [by_lane[lane][0].arrived + bound - horizon for lane in lanes[1:]]
        return min(times) if times else None


def _burst(share: float) -> float:
    """Credit a quiet lane saves up, so a clump of its requests all make the bound."""
    return BURST_BATCHES * max(1.0, share)


def group_by_lane(waiting: Sequence[Waiting]) -> dict[int, list[Waiting]]:
    """Lane → its requests, oldest first (ties by key, so the order is deterministic)."""
    by_lane: dict[int, list[Waiting]] = {}
    for w in waiting:
        lst = by_lane.get(w.lane)
        if lst is None:
            by_lane[w.lane] = [w]
        else:
            lst.append(w)
    for lst in by_lane.values():
        if len(lst) > 1:
            lst.sort(key=_age_key)
    return by_lane


def _age_key(w: Waiting) -> tuple[float, str]:
    return (w.arrived, w.key)


def split_budget(budget: int, lanes: Sequence[int], policy: Policy) -> dict[int, int]:
    """Share a read budget over the lanes' streams by lane weight (each lane at least 1).

    Reading the same count from every lane would fill the worker with a flooded low
    lane's requests and leave too few of lane 0's to give it its share; reading lane 0
    first would never read a low lane under load. A caller that gets fewer than asked
    from a lane may spend the rest on the other lanes, in lane order.
    """
    if budget <= 0 or not lanes:
        return {}
    total = sum(lane_weight(policy, lane) for lane in lanes)
    return {lane: max(1, round(budget * lane_weight(policy, lane) / total)) for lane in lanes}
