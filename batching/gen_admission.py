"""Admission of waiting generation requests, in lane order, and the credit it keeps.

The third part of a plan (:meth:`~.generation.GenerationPolicy.plan`): strict priority by
lane, oldest first, lower lanes promoted when they starve and metered by lane weight
(:class:`~.lanes.LaneScheduler`), while slots, KV blocks (less the watermark) and the
prefill backlog allow; lane 0 may preempt lower lanes' sequences to fit
(:mod:`.gen_victims`). Its state, kept between plans, is credit only: the lower lanes'
for promotion and lane 0's for going ahead of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .gen_blocks import admission_blocks
from .gen_types import GenPolicy, GenRunning, GenWaiting
from .gen_victims import Victim, by_order, cover, victims
from .lanes import LaneScheduler, group_by_lane, lane_weight
from .types import Policy, Waiting

PREFILL_STEPS = 4
"""Admission stops while the prompt tokens that would prefill before a candidate (its own,
and the unprefilled tokens of running and admitted requests of its lane and higher ones)
exceed this many steps' token budgets: admitted requests then start within about that
many steps instead of holding KV memory while they queue for prefill. A request alone
over it still goes when nothing of its lane or higher lanes is prefilling."""

LANE0_BURST = 1.5
"""Lane 0 saves at most this many rows of credit to go ahead of starving lower lanes: a
longer run of lane-0 admissions ahead of them would push them past their bound."""


class Admission:
    """Admits waiting requests in lane order; state: the lanes' and lane 0's credit."""

    def __init__(self) -> None:
        self._lanes = LaneScheduler()
        self._lane0_credit = LANE0_BURST
        """Lane 0's weighted share of admitted rows, spent when it goes ahead of starving
        lower lanes (see :meth:`admit`), up to :data:`LANE0_BURST` rows."""

    def credit(self) -> tuple[dict[int, float], float]:
        """The credit a plan spends (see :meth:`restore`)."""
        return dict(self._lanes._deficit), self._lane0_credit

    def restore(self, credit: tuple[dict[int, float], float]) -> None:
        """Credit as :meth:`credit` returned it: a plan withdrawn before it ran (planned
        again with a newer view) spends nothing."""
        self._lanes._deficit, self._lane0_credit = dict(credit[0]), credit[1]

    def admit(
        self,
        pol: GenPolicy,
        candidates: list[GenWaiting],
        live: list[GenRunning],
        used: int,
        seqs: int,
        now: float,
        slack: float,
        preempt: list[Victim],
    ) -> list[str]:
        """Keys to admit, in lane order while they fit (see :meth:`GenerationPolicy.plan`,
        step 3): ``live`` run on, holding ``used`` blocks and ``seqs`` slots; ``preempt``
        grows with lane 0's victims. Spends and earns the lanes' credit."""
        page = pol.page_size
        room = pol.total_blocks - pol.watermark_blocks
        if not candidates:
            return []
        if _slots_full(candidates, seqs, pol.max_running):
            return []  # (the common saturated step: the ordering below is O(waiting))
        by_key = {w.key: w for w in candidates}
        by_lane = group_by_lane([_as_waiting(w) for w in candidates])
        lane_policy = _lane_policy(pol)
        promoted, rest = self._lanes.order(by_lane, now, slack, 1, lane_policy)
        promoted_keys = {w.key for w in promoted}
        # Promoted requests go first, but lane 0 may go ahead of them while it has credit.
        promoted_q = deque(promoted)
        top_q = deque(w for w in rest if w.lane == 0)
        low_q = deque(w for w in rest if w.lane != 0)

        # Unprefilled prompt tokens per lane, running and admitted: the prefill backlog.
        backlog: dict[int, int] = {}
        for r in live:
            backlog[r.lane] = backlog.get(r.lane, 0) + sum(r.prefill_left)
        prefill_cap = PREFILL_STEPS * pol.step_tokens
        # Lane 0 may preempt lower lanes, but not what starvation promotion admitted
        # (started past its promotion instant): that would undo the bound it yields to.
        # Once a promoted request waits past its bound anyway (the lower lanes' own load
        # is past what the device serves), lane 0 may, on credit, preempt those that
        # were never preempted: no bound is left to keep, and lane 0 keeps its share.
        promote_after = pol.max_starvation_ms / 1000.0 - slack
        bound = pol.max_starvation_ms / 1000.0
        lost = any(w.arrived <= now - bound for w in promoted)
        lower: list[GenRunning] = []
        promoted_lower: list[GenRunning] = []
        for r in by_order(live):
            if r.lane == 0:
                continue
            if r.started_at < r.arrived_at + promote_after:
                lower.append(r)
            elif lost and r.preempted == 0:
                promoted_lower.append(r)
        ours = victims(lower, page)
        promoted_victims = victims(promoted_lower, page)

        admit: list[str] = []
        promoted_rows: dict[int, int] = {}
        charged = 0
        may_jump = True
        while top_q or promoted_q or low_q:
            jumped = False
            has_credit = self._lane0_credit - charged >= 1.0 - 1e-9
            if top_q and (not promoted_q or (may_jump and has_credit)):
                jumped = bool(promoted_q)
                item = top_q.popleft()
            elif promoted_q:
                item = promoted_q.popleft()
            else:
                item = low_q.popleft()
            w = by_key[item.key]
            if w.parent is not None and any(v.run.key == w.parent for v in preempt):
                continue  # its request is being freed by this plan: not back into it now
            need = admission_blocks(w, page)
            n = len(w.prompts)
            ahead = sum(v for lane, v in backlog.items() if lane <= w.lane)
            tokens = sum(w.prompts)
            fits = not (ahead and ahead + tokens > prefill_cap)
            freed: list[Victim] | None = []
            made_room = on_credit = False
            if fits and (used + need > room or seqs + n > pol.max_running):
                freed = None
                if w.lane == 0:
                    short = (used + need - room, seqs + n - pol.max_running)
                    freed = cover(ours, *short)
                    if freed is None and has_credit and promoted_victims:
                        freed = cover(ours + promoted_victims, *short)
                        on_credit = freed is not None
            if not fits or freed is None:
                if jumped:  # the starving requests it went ahead of may fit: back in line
                    top_q.appendleft(item)
                    may_jump = False
                    continue
                if item.key in promoted_keys and top_q:
                    # A promoted request that does not fit blocks the line; lane 0 behind it
                    # (no credit) may still go by freeing at least all it takes from lower
                    # lanes: the promoted request then waits for no less than before.
                    made = _lane0_room(by_key[top_q[0].key], ours, used, seqs, backlog, pol)
                    if made is not None:
                        promoted_q.appendleft(item)
                        item, freed = top_q.popleft(), made
                        w = by_key[item.key]
                        need, n, tokens = admission_blocks(w, page), len(w.prompts), sum(w.prompts)
                        made_room = True
                if not made_room:
                    break
            if freed:
                for v in freed:
                    (ours if v in ours else promoted_victims).remove(v)
                    preempt.append(v)
                    used -= v.blocks
                    seqs -= v.slots
                    backlog[v.run.lane] -= v.prefill
            admit.append(w.key)
            if w.parent is not None:  # its request takes it back in this plan: it runs on
                ours = [v for v in ours if v.run.key != w.parent]
                promoted_victims = [v for v in promoted_victims if v.run.key != w.parent]
            used += need
            seqs += n
            backlog[w.lane] = backlog.get(w.lane, 0) + tokens
            if w.key in promoted_keys:
                promoted_rows[w.lane] = promoted_rows.get(w.lane, 0) + n
            if jumped or on_credit:
                charged += n
        if admit:
            rows = sum(len(by_key[k].prompts) for k in admit)
            self._lanes.commit(by_lane, promoted_rows, rows, lane_policy, rows)
            lanes = set(by_lane) | {0}
            share = lane_weight(lane_policy, 0) / sum(lane_weight(lane_policy, x) for x in lanes)
            credit = self._lane0_credit - charged + rows * share
            self._lane0_credit = min(credit, LANE0_BURST)
        return admit


def _slots_full(candidates: Sequence[GenWaiting], seqs: int, max_running: int) -> bool:
    """Every slot is taken and no candidate is lane 0's (which alone may preempt for
    one): whoever is first in line cannot fit, so admission takes no one and spends no
    credit, as :meth:`Admission.admit`'s loop would find after ordering them."""
    return seqs >= max_running and all(w.lane != 0 and w.prompts for w in candidates)


def _lane0_room(
    w: GenWaiting,
    victims: list[Victim],
    used: int,
    seqs: int,
    backlog: dict[int, int],
    pol: GenPolicy,
) -> list[Victim] | None:
    """Lower-lane sequences whose freeing covers all that lane-0 request ``w`` takes and
    lets it fit (so the resources anyone else waits for do not shrink); None if it cannot
    go that way (too few victims, or lane 0's own prefill backlog is full)."""
    page = pol.page_size
    need, n, tokens = admission_blocks(w, page), len(w.prompts), sum(w.prompts)
    ahead = backlog.get(0, 0)
    if ahead and ahead + tokens > PREFILL_STEPS * pol.step_tokens:
        return None
    room = pol.total_blocks - pol.watermark_blocks
    return cover(victims, max(need, used + need - room), max(n, seqs + n - pol.max_running))


def _as_waiting(w: GenWaiting) -> Waiting:
    return Waiting(w.key, w.lane, w.arrived_at, sum(w.prompts), len(w.prompts), w.deadline)


def _lane_policy(pol: GenPolicy) -> Policy:
    return Policy(
        max_batch_size=pol.max_running,
        lane_weights=pol.lane_weights,
        max_starvation_ms=pol.max_starvation_ms,
        lanes=pol.lanes,
    )
