"""A histogram of inter-token latency filled a step at a time (``TokenGaps``), for
``batchfleet_inter_token_latency_seconds`` and vLLM's ``vllm:inter_token_latency_seconds``."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import Counter as Tally
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 0.75, 1, 2.5, 5)  # fmt: skip
"""Inter-token latency: a step's length on a loaded GPU (a few ms) up to a preemption's gap."""


_last: tuple[Sequence[tuple[int, float]], Tally[tuple[int, float]]] | None = None
"""The gaps last tallied and their tally (see :func:`tally`)."""


def tally(gaps: Sequence[tuple[int, float]]) -> Tally[tuple[int, float]]:
    """How many times each (lane, seconds) gap occurs. A step's gaps go to two histograms
    (batchfleet's and vLLM's): the same sequence is counted once (about 10 µs a step on
    the loop thread). Any thread: the one memo is swapped whole, and holds the sequence
    it counted, so the same tuple is the same gaps (a list may have changed since)."""
    global _last
    last = _last
    if last is not None and last[0] is gaps:
        return last[1]
    counted = Tally(gaps)
    if type(gaps) is tuple:
        _last = (gaps, counted)
    return counted


class TokenGaps(Collector):  # type: ignore[misc]
    """A histogram of inter-token latency filled a step at a time (by default
    ``batchfleet_inter_token_latency_seconds``, per model and lane). A step closes one gap
    per running request, nearly all the same (the step before ended them), so each
    distinct gap is counted once with its number, rather than observed per token through
    ``Histogram`` (about 2 µs each, on the loop thread, beside the device's Python)."""

    NAME = "batchfleet_inter_token_latency_seconds"

    def __init__(
        self,
        name: str = NAME,
        doc: str = "Generation: time between a request's tokens (step to step; a preemption's "
        "gap counts once).",
        labels: Sequence[str] = ("model", "lane"),
        buckets: Sequence[float] = ITL_BUCKETS,
        aliases: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.names = [(name, doc), *aliases]
        """The family's name and documentation, then other (name, doc) the same series go
        under (a deprecated name kept for dashboards that still query it)."""
        self.labels, self.buckets = list(labels), tuple(buckets)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        """labels -> (count per bucket, the last one +Inf; [sum])"""

    def add(self, model: str, gaps: Sequence[tuple[int, float]]) -> None:
        """A step's gaps: (lane, seconds) per request, a series per model and lane. The
        gaps are counted as they come (in C) before any is labelled: a step has a
        handful of distinct ones among a gap per running request."""
        self._add(((model, str(lane)), seconds, n) for (lane, seconds), n in tally(gaps).items())

    def add_to(self, key: tuple[str, ...], gaps: Sequence[tuple[int, float]]) -> None:
        """A step's gaps: (lane, seconds) per request, all in the one series ``key``."""
        self._add((key, seconds, n) for (_, seconds), n in tally(gaps).items())

    def _add(self, counted: Iterable[tuple[tuple[str, ...], float, int]]) -> None:
        """(label values, seconds, how many) per distinct gap."""
        with self._lock:
            for key, seconds, n in counted:
                found = self._series.get(key)
                if found is None:
                    found = self._series[key] = ([0] * (len(self.buckets) + 1), [0.0])
                counts, total = found
                counts[bisect.bisect_left(self.buckets, seconds)] += n
                total[0] += seconds * n

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            series = [(k, list(c), t[0]) for k, (c, t) in self._series.items()]
        bounds = [str(float(b)) for b in self.buckets] + ["+Inf"]
        for name, doc in self.names:
            family = HistogramMetricFamily(name, doc, labels=self.labels)
            for labels, counts, total in series:
                cumulative = list(itertools.accumulate(counts))
                family.add_metric(list(labels), list(zip(bounds, cumulative, strict=True)), total)
            yield family
