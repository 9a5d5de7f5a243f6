"""When to dispatch a batch that is not full: the adaptive (or fixed) wait decision.

The adaptive rule. With the device idle and ``n`` rows ready, compare dispatching now
with waiting a moment ``dt`` more. A batch costs ``T(n) = a + m·n`` (``a``: the fixed
overhead the cost model learns, ``m``: per-row cost). Waiting delays the ``n`` ready
rows by ``dt`` plus the extra compute of the newcomers, ``n·(1 + λ·m)·dt`` in total;
it lets the ``λ·dt`` rows arriving meanwhile ride along instead of waiting out the
whole next batch, saving them about ``λ·dt·T(n)``. Waiting pays iff

    λ·(a + m·n) > n·(1 + λ·m)   ⇔   n < λ·a

— keep waiting only while fewer rows are ready than arrive during one batch overhead.
At low load (``λ·a < 1``) a lone request is dispatched at once (no window is paid);
once the device has been busy, more than ``λ·a`` rows have piled up and batches leave
as soon as it frees (greedy batching, which is stable up to the device's limit). The
wait is further bounded by ``max_wait_ms`` from the oldest member, by each member's
deadline slack (the latest start at which the batch still finishes in time) and by
the starvation bound. ``λ`` is the measured arrival rate, which decays when arrivals
stop, so a wait that does not fill ends soon.

``adaptive=False``: the plain fixed window — wait until the oldest member has waited
``max_wait_ms`` or the batch is full (deadlines and starvation still cut it short).
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import Policy, Reason


@dataclass(frozen=True, slots=True)
class Decision:
    """Dispatch now for ``reason``, or (``reason`` None) wait until ``wake_at``."""

    reason: Reason | None
    wake_at: float | None = None


def decide(
    *,
    now: float,
    rows: int,
    full: bool,
    oldest: float,
    latest_start: float | None,
    starve_at: float | None,
    policy: Policy,
    rate: float,
    overhead: float,
) -> Decision:
    """Decide for a batch of ``rows`` rows whose oldest member arrived at ``oldest``.

    ``latest_start``: the last start that meets every member's deadline (None: none).
    ``starve_at``: when a lower-lane request reaches its starvation bound (None: none).
    ``rate``: rows/s arriving; ``overhead``: the batch's fixed cost in seconds.
    """
    if full:
        return Decision("full")
    if latest_start is not None and now >= latest_start:
        return Decision("deadline")
    if starve_at is not None and now >= starve_at:
        return Decision("starvation")
    worth = rate * overhead
    if policy.adaptive and rows >= worth:
        return Decision("idle")
    window_end = oldest + policy.max_wait_ms / 1000.0
    if now >= window_end:
        return Decision("window")
    wake = window_end
    if policy.adaptive:
        wake = min(wake, now + (worth - rows) / rate)
    if latest_start is not None:
        wake = min(wake, latest_start)
    if starve_at is not None:
        wake = min(wake, starve_at)
    return Decision(None, wake)
