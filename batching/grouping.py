"""Which waiting requests form the next batch: caps, deadlines, length and batch size.

First a greedy pass takes requests in priority order (promoted, then lane by lane,
oldest first) while they fit the row cap, the padded-token cap, and every member's
deadline. Then, when padding costs anything, the batch is re-chosen for throughput:

* Two requests *must go*: the *anchor* (the first in priority order after the promoted
  ones: the oldest of the highest lane waiting) and the oldest promoted one, if any.
* The rest come from a *pool*: the other promoted requests, then the next few batches'
  worth in priority order, where a lower lane joins only while the lanes above it hold
  less than a good batch's worth (so a higher lane with enough of its own is not diluted).
* Among the windows of the pool contiguous in token-length order (anywhere: often beside
  the longest must-go), it takes the most *efficient* batch: what its rows would cost in
  batches of their own length and best size, over what it costs. A batch of equal
  lengths at the best size scores 1; padding, unshared overhead and (on a CPU) a batch
  bigger than the best size lower it. So the batch size is chosen too, and a short
  request joins long ones only if the overhead it saves pays for its padding. Ties: the
  least padding. Only a gain of :data:`MIN_GAIN` over the greedy choice counts.

A request of unusual length is overtaken only until it is the anchor (or the oldest
promoted). Deadlines are kept: a regrouped batch that would miss one is not used.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .types import Waiting

Estimate = Callable[[int, int], float]
RowCost = Callable[[int], float]
"""Seconds per row for rows of that many tokens, in a full batch of the best size."""
BestRows = Callable[[int], int]
"""The batch size with the least time per row, for rows of that many tokens."""

POOL_BATCHES = 4
"""Length grouping looks at this many batches' worth of requests in priority order."""
MIN_GAIN = 0.01
"""Regroup only when the batch's efficiency improves by at least this share."""


@dataclass(slots=True)
class Composition:
    """The chosen members, in priority order, and whether the batch is at a cap."""

    items: list[Waiting]
    full: bool
    """At a cap, or cut short on purpose (more is held than the best batch takes)."""
    rows: int
    max_tokens: int
    min_deadline: float


def compose(
    ordered: Sequence[Waiting],
    *,
    row_cap: int,
    token_cap: int | None,
    start: float,
    estimate: Estimate,
    row_cost: RowCost | None = None,
    best_rows: BestRows | None = None,
    fixed: int = 0,
) -> Composition:
    """Choose the batch from ``ordered`` (priority order) to start at ``start``.

    The first ``fixed`` entries of ``ordered`` are promoted requests, oldest first: the
    oldest always goes, the others may be swapped for length (a promoted lane's credit
    is spent only on those that go). A request over a cap still goes alone.
    ``row_cost`` None: padding costs nothing, the greedy choice stands. ``best_rows``
    (default: ``row_cap``) sizes the pool's lanes (see :func:`pool_of`).
    """
    chosen: list[int] = []
    rows = 0
    max_tok = 0
    min_dl = math.inf
    full = False
    for idx, w in enumerate(ordered):
        if rows >= row_cap:
            full = True
            break
        n_rows = rows + w.size
        n_tok = w.tokens if w.tokens > max_tok else max_tok
        if chosen and (n_rows > row_cap or (token_cap is not None and n_rows * n_tok > token_cap)):
            full = True
            continue
        dl = w.deadline if w.deadline is not None and w.deadline < min_dl else min_dl
        if dl != math.inf and start + estimate(n_rows, n_rows * n_tok) > dl:
            continue
        chosen.append(idx)
        rows, max_tok, min_dl = n_rows, n_tok, dl
    if token_cap is not None and (rows + 1) * max_tok > token_cap:
        full = True
    if row_cost is not None and chosen and len(ordered) > 1:
        enough = (
            row_cap
            if best_rows is None
            else best_rows(ordered[min(fixed, len(ordered) - 1)].tokens)
        )
        better = _regroup(
            ordered, chosen, row_cap, token_cap, start, estimate, row_cost, fixed, enough
        )
        if better is not None:
            full = full or len(better) < len(ordered)
            chosen = better
            rows = sum(ordered[i].size for i in chosen)
            max_tok = max(ordered[i].tokens for i in chosen)
            min_dl = min(
                (d for i in chosen if (d := ordered[i].deadline) is not None),
                default=math.inf,
            )
    return Composition([ordered[i] for i in chosen], full, rows, max_tok, min_dl)


def pool_of(ordered: Sequence[Waiting], fixed: int, row_cap: int, enough: int) -> list[int]:
    """Indices the batch may be re-chosen from, in priority order: the promoted ones but
    the oldest (``ordered[1:fixed]``), then the rest after the anchor (``ordered[fixed]``)
    up to :data:`POOL_BATCHES` batches of rows, where a lower lane joins only while the
    lanes above it hold fewer than ``enough`` rows (a good batch's worth), so a higher
    lane with enough for a batch of its own is never diluted by lower ones."""
    pool = list(range(1, fixed))
    limit = POOL_BATCHES * row_cap
    rows = 0
    lane = None
    for i in range(fixed, len(ordered)):
        w = ordered[i]
        if w.lane != lane:
            if rows >= enough:
                break
            lane = w.lane
        if rows + w.size > limit and rows:
            break
        if i != fixed:
            pool.append(i)
        rows += w.size
    return pool


def must_go(fixed: int) -> list[int]:
    """Indices that always go: the oldest promoted request (promoted ones are sorted by
    age, so each promoted lane's oldest becomes it within a batch or two) and the anchor."""
    return [0, fixed] if fixed > 0 else [fixed]


def _regroup(
    ordered: Sequence[Waiting],
    chosen: list[int],
    row_cap: int,
    token_cap: int | None,
    start: float,
    estimate: Estimate,
    row_cost: RowCost,
    fixed: int,
    enough: int,
) -> list[int] | None:
    """Re-choose the batch for throughput; None keeps the greedy choice.

    The batch is the must-go requests plus a window of the pool, contiguous in length
    order, anywhere (beside the longest must-go, typically): the one with the best
    efficiency. A member that cannot make its deadline keeps the greedy choice.
    """
    if fixed >= len(ordered):
        return None  # only promoted requests: nothing to anchor on
    keep = must_go(fixed)
    pool_idx = pool_of(ordered, fixed, row_cap, enough)
    if not pool_idx:
        return None
    fixed_rows = sum(ordered[i].size for i in keep)
    fixed_tok = max(ordered[i].tokens for i in keep)
    fixed_real = sum(ordered[i].tokens * ordered[i].size for i in keep)
    avail = row_cap - fixed_rows
    over_tokens = token_cap is not None and fixed_rows * fixed_tok > token_cap
    if len(keep) > 1 and (avail < 0 or over_tokens):
        return None  # the must-go pair alone breaks a cap: the greedy choice handles it

    cache: dict[int, float] = {}

    def ideal(w: Waiting) -> float:
        u = cache.get(w.tokens)
        if u is None:
            u = cache[w.tokens] = row_cost(w.tokens)
        return u * w.size

    # Sorted by length, ties in priority order: a window takes a higher lane's request
    # before a lower lane's of the same length.
    pool = sorted(pool_idx, key=lambda i: (ordered[i].tokens, i))
    toks = [ordered[i].tokens for i in pool]
    row_sum = [0]
    real_sum = [0]
    ideal_sum = [0.0]
    for i in pool:
        w = ordered[i]
        row_sum.append(row_sum[-1] + w.size)
        real_sum.append(real_sum[-1] + w.tokens * w.size)
        ideal_sum.append(ideal_sum[-1] + ideal(w))
    ideal_fixed = sum(ideal(ordered[i]) for i in keep)

    def score(rows: int, longest: int, ideal_rows: float) -> float:
        return ideal_rows / estimate(rows, rows * longest)

    # Score: what the rows would cost in batches of their own length and best size,
    # over what this batch costs. Ties: less padding. Start with the must-go alone.
    alone = score(fixed_rows, fixed_tok, ideal_fixed)
    best: tuple[float, int, int, int] = (alone, -(fixed_rows * fixed_tok - fixed_real), 0, -1)
    # A window ending below the longest must-go is padded to it anyway: of those, the one
    # ending at the last such length scores best (longer rows, same cost), so start there:
    # at the first row of that length, so that of windows scoring alike (rows of one length)
    # the first found, and kept, is the one of the oldest and highest-lane requests.
    last = max(0, bisect.bisect_right(toks, fixed_tok) - 1)
    first = bisect.bisect_left(toks, toks[last])
    for j in range(first, len(pool)):
        longest = max(fixed_tok, toks[j])
        prev = -1.0
        for i in range(j, -1, -1):
            r = row_sum[j + 1] - row_sum[i]
            if r > avail:
                break
            rows = fixed_rows + r
            if token_cap is not None and rows * longest > token_cap:
                break
            sc = score(rows, longest, ideal_fixed + ideal_sum[j + 1] - ideal_sum[i])
            if sc < prev * (1 - 1e-9):
                break  # adding ever shorter rows only lowers it from here
            prev = sc
            waste = rows * longest - (fixed_real + real_sum[j + 1] - real_sum[i])
            if sc > best[0] * (1 + 1e-9) or (sc >= best[0] * (1 - 1e-9) and -waste > best[1]):
                best = (sc, -waste, i, j)
    # Reordering costs fairness (younger rows overtake older ones): only for a real gain,
    # unless the greedy choice leaves a must-go out (promoted requests filled it).
    if all(k in chosen for k in keep):
        g_rows = sum(ordered[k].size for k in chosen)
        g_longest = max(ordered[k].tokens for k in chosen)
        g_score = score(g_rows, g_longest, sum(ideal(ordered[k]) for k in chosen))
        if best[0] < g_score * (1 + MIN_GAIN):
            return None
    _, _, i, j = best
    members = sorted(keep + pool[i : j + 1])
    rows = sum(ordered[k].size for k in members)
    max_tok = max(ordered[k].tokens for k in members)
    dls = [d for k in members if (d := ordered[k].deadline) is not None]
    if dls and start + estimate(rows, rows * max_tok) > min(dls):
        return None
    return members
