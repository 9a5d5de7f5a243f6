"""Labelled series of ``prometheus_client`` metrics, looked up once and updated at a
step's cost, for the observers the loop and its sink call every step.

``family.labels(...)`` costs more than the update it is for, and ``Histogram.observe``
checks its labels and walks its buckets in Python a value at a time. :class:`Series`
keeps each labelled child; :class:`Hist` adds values to a histogram child in one pass
(bucket counts tallied, each value added to the sum in order, so ``_sum`` is the very
float that ``observe`` one at a time gives); :class:`Level` sets a gauge child only
when its value changed. The exposition is byte for byte the public API's
(tests/test_metric_children.py).

:class:`Hist` writes a child's bucket and sum values (``_upper_bounds``, ``_buckets``,
``_sum``: prometheus_client has no public bulk observe); a child without them (another
version) falls back to ``observe``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
W = TypeVar("W", "Hist", "Level")


class Hist:
    """A histogram child: ``observe`` one value, ``observe_all`` many in one pass."""

    __slots__ = ("_bounds", "_buckets", "_sum", "child")

    def __init__(self, child: Any) -> None:
        self.child = child
        self._bounds: list[float] | None = getattr(child, "_upper_bounds", None)
        self._buckets: list[Any] | None = getattr(child, "_buckets", None)
        self._sum: Any = getattr(child, "_sum", None)
        if self._buckets is None or self._sum is None or self._bounds is None:
            self._bounds = None

    def observe(self, value: float) -> None:
        """``Histogram.observe(value)``: the sum, then the first bucket ``value`` fits."""
        bounds = self._bounds
        if bounds is None:
            self.child.observe(value)
            return
        self._sum.inc(value)
        if value == value:  # NaN fits no bucket
            self._buckets[bisect_left(bounds, value)].inc(1)  # type: ignore[index]

    def observe_all(self, values: Iterable[float]) -> None:
        """``observe`` each value, in order; each bucket counted up once."""
        bounds = self._bounds
        if bounds is None:
            for value in values:
                self.child.observe(value)
            return
        add = self._sum.inc
        counts = [0] * len(bounds)
        for value in values:
            add(value)  # one at a time, in order: the same float sum as observe's
            if value == value:
                counts[bisect_left(bounds, value)] += 1
        buckets = self._buckets
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)  # type: ignore[index]


class Level:
    """A gauge child, set only when its value changed (the series' one writer is this)."""

    __slots__ = ("_last", "child")

    def __init__(self, child: Any) -> None:
        self.child = child
        self._last: float | None = None

    def set(self, value: float) -> None:
        if value != self._last:
            self.child.set(value)
            self._last = value


class Series:
    """Each family's labelled children, looked up once: ``count`` (a counter's or any
    child), ``hist`` (:class:`Hist`) and ``level`` (:class:`Level`); ``group``: the
    series an event always updates, in one lookup."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        """(family id, label values) -> its child; the families live as long as the
        observer that holds this (their registry's)."""
        self._hists: dict[tuple[int, tuple[str, ...]], Hist] = {}
        self._levels: dict[tuple[int, tuple[str, ...]], Level] = {}
        self._groups: dict[tuple[str, ...], Any] = {}

    def count(self, family: Any, *labels: str) -> Any:
        key = (id(family), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels)
        return child

    def hist(self, family: Any, *labels: str) -> Hist:
        return self._wrapped(self._hists, Hist, family, labels)

    def level(self, family: Any, *labels: str) -> Level:
        return self._wrapped(self._levels, Level, family, labels)

    def _wrapped(
        self,
        found: dict[tuple[int, tuple[str, ...]], W],
        wrap: Callable[[Any], W],
        family: Any,
        labels: tuple[str, ...],
    ) -> W:
        key = (id(family), labels)
        wrapper = found.get(key)
        if wrapper is None:
            wrapper = found[key] = wrap(self.count(family, *labels))
        return wrapper

    def group(self, key: tuple[str, ...], make: Callable[[], T]) -> T:
        """``make()``'s series (looked up, so made on ``key``'s first event), kept."""
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = make()
        return found
