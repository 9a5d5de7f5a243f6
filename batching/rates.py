"""Arrival-rate learning from what the worker hands the engine.

The engine is only ever given the set of requests currently waiting. A key it has not
seen before is a new arrival, and its ``arrived`` time is when it entered the queue
(not when the worker read it), so rates stay right however late the worker reads.
Memory is bounded: the keys of the last call, a bounded record of keys that left, and
the last :data:`WINDOW` arrivals per lane.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from .types import Waiting

WINDOW = 64
"""Arrivals per lane the rate is computed over: adapts within ~64 requests."""
GONE_MEMORY = 4096
"""Keys that left (dispatched, expired) remembered so a re-offered one is not new."""


class ArrivalRates:
    """Rows per second arriving, per lane, learnt from first sightings of keys."""

    def __init__(self) -> None:
        self._current: set[str] = set()
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._lanes: dict[int, deque[tuple[float, int]]] = {}

    def learn(self, waiting: Sequence[Waiting]) -> None:
        """Record the arrivals among ``waiting`` that were not there on the last call."""
        current = self._current
        fresh = [w for w in waiting if w.key not in current and w.key not in self._gone]
        keys = {w.key for w in waiting}
        left = current - keys
        if left:
            gone = self._gone
            for key in left:
                gone[key] = None
            while len(gone) > GONE_MEMORY:
                gone.popitem(last=False)
        self._current = keys
        if not fresh:
            return
        fresh.sort(key=lambda w: w.arrived)
        for w in fresh:
            lane = self._lanes.get(w.lane)
            if lane is None:
                lane = self._lanes[w.lane] = deque(maxlen=WINDOW)
            lane.append((w.arrived, w.size))

    def rate(self, now: float, lane: int | None = None) -> float:
        """Rows/s over the recent window (all lanes when ``lane`` is None).

        Counts the arrivals after the window's first one over the time since it, so the
        estimate decays on its own when arrivals stop.
        """
        if lane is None:
            return sum(self._rate(now, q) for q in self._lanes.values())
        q = self._lanes.get(lane)
        return 0.0 if q is None else self._rate(now, q)

    @staticmethod
    def _rate(now: float, q: deque[tuple[float, int]]) -> float:
        if len(q) < 2:
            return 0.0
        first = q[0][0]
        span = now - first
        if span <= 0:
            return 0.0
        return (sum(size for _, size in q) - q[0][1]) / span
