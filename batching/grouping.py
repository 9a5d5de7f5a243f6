"""Which waiting requests form the next batch: caps, deadlines and length grouping.

First a greedy pass takes requests in priority order (promoted, then lane by lane,
oldest first) while they fit the row cap, the padded-token cap, and every member's
deadline. Then, if the last lane it reached was cut by a cap, that lane's share is
re-chosen for length: among the lane's oldest requests (a pool of a few batches) it
takes the window of similar token lengths, in sorted order, that contains the lane's
oldest request and gives the best estimated throughput (rows per second: with a
token-dependent cost, a short homogeneous batch can beat a full mixed one), then wastes
the fewest padded tokens. Higher lanes keep their places
(priority first), and the oldest request always goes (so a request of unusual length
is overtaken only until it is the oldest: it then leads a batch of its neighbours).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .types import Waiting

Estimate = Callable[[int, int], float]

POOL_BATCHES = 4
"""Length grouping looks at this many batches' worth of the cut lane's oldest requests."""
MIN_GAIN = 0.01
"""Regroup only when the batch's efficiency improves by at least this share."""


@dataclass(slots=True)
class Composition:
    """The chosen members, in priority order, and whether the batch is at a cap."""

    items: list[Waiting]
    full: bool
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
    fixed: int = 0,
) -> Composition:
    """Choose the batch from ``ordered`` (priority order) to start at ``start``.

    The first ``fixed`` entries of ``ordered`` (promoted requests) are never swapped
    out for length. A request larger than a cap on its own still goes alone.
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
    if full and chosen:
        better = _group_by_length(ordered, chosen, row_cap, token_cap, start, estimate, fixed)
        if better is not None:
            chosen = better
            rows = sum(ordered[i].size for i in chosen)
            max_tok = max(ordered[i].tokens for i in chosen)
            min_dl = min(
                (ordered[i].deadline for i in chosen if ordered[i].deadline is not None),
                default=math.inf,
            )
    return Composition([ordered[i] for i in chosen], full, rows, max_tok, min_dl)


def _group_by_length(
    ordered: Sequence[Waiting],
    chosen: list[int],
    row_cap: int,
    token_cap: int | None,
    start: float,
    estimate: Estimate,
    fixed: int,
) -> list[int] | None:
    """Re-choose the cut lane's members for low padding; None keeps the greedy choice."""
    flexible = [i for i in chosen if i >= fixed]
    if not flexible:
        return None
    lane = ordered[flexible[-1]].lane
    lane_idx = [i for i in range(fixed, len(ordered)) if ordered[i].lane == lane]
    in_lane = [i for i in chosen if i >= fixed and ordered[i].lane == lane]
    if in_lane[0] != lane_idx[0]:
        return None  # its oldest could not go (deadline): keep the simple choice
    keep = [i for i in chosen if i < fixed or ordered[i].lane != lane]
    pool_idx = lane_idx[: POOL_BATCHES * row_cap]
    if len(pool_idx) <= len(in_lane):
        return None
    fixed_rows = sum(ordered[i].size for i in keep)
    fixed_tok = max((ordered[i].tokens for i in keep), default=0)
    fixed_real = sum(ordered[i].tokens * ordered[i].size for i in keep)
    avail = row_cap - fixed_rows

    pool = sorted(pool_idx, key=lambda i: (ordered[i].tokens, i))
    toks = [ordered[i].tokens for i in pool]
    row_sum = [0]
    real_sum = [0]
    for i in pool:
        w = ordered[i]
        row_sum.append(row_sum[-1] + w.size)
        real_sum.append(real_sum[-1] + w.tokens * w.size)
    p = pool.index(lane_idx[0])

    def fits(i: int, j: int) -> bool:
        r = row_sum[j + 1] - row_sum[i]
        if r > avail:
            return False
        return token_cap is None or (fixed_rows + r) * max(fixed_tok, toks[j]) <= token_cap

    # Score a batch by its efficiency: what its rows would cost in full batches of their
    # own length, over what it costs. A full batch of equal lengths scores 1; padding
    # and unused overhead lower it, so a short item goes with a long batch only if the
    # overhead it saves pays for its padding. Ties: less padding.
    unit = estimate(row_cap, 0) / row_cap
    per_token = estimate(row_cap, row_cap) / row_cap - unit
    ideal_fixed = fixed_rows * unit + per_token * fixed_real
    best: tuple[float, int, int, int] | None = None  # (score, -waste, i, j)
    for j in range(p, len(pool)):
        if not fits(p, j):
            break  # windows ending further right only get longer
        longest = max(fixed_tok, toks[j])
        prev = -1.0
        for i in range(p, -1, -1):
            if not fits(i, j):
                break
            rows = fixed_rows + row_sum[j + 1] - row_sum[i]
            real = fixed_real + real_sum[j + 1] - real_sum[i]
            ideal = ideal_fixed + (row_sum[j + 1] - row_sum[i]) * unit
            score = (ideal + per_token * (real - fixed_real)) / estimate(rows, rows * longest)
            if score < prev * (1 - 1e-9):
                break  # adding ever shorter rows only lowers it from here
            prev = score
            waste = rows * longest - real
            if (
                best is None
                or score > best[0] * (1 + 1e-9)
                or (score >= best[0] * (1 - 1e-9) and -waste > best[1])
            ):
                best = (score, -waste, i, j)
    if best is None:
        return None
    # Reordering costs fairness (younger rows overtake older ones): only for a real gain.
    g_rows = fixed_rows + sum(ordered[k].size for k in in_lane)
    g_real = fixed_real + sum(ordered[k].tokens * ordered[k].size for k in in_lane)
    g_longest = max(fixed_tok, max(ordered[k].tokens for k in in_lane))
    g_score = (g_rows * unit + per_token * g_real) / estimate(g_rows, g_rows * g_longest)
    if best[0] < g_score * (1 + MIN_GAIN):
        return None
    _, _, i, j = best
    members = sorted(keep + pool[i : j + 1])
    rows = fixed_rows + row_sum[j + 1] - row_sum[i]
    max_tok = max(fixed_tok, toks[j])
    dls = [ordered[k].deadline for k in members if ordered[k].deadline is not None]
    if dls and start + estimate(rows, rows * max_tok) > min(dls):
        return None
    return members
