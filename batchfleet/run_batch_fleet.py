"""``batchfleet run-batch --enable-metrics``: the fleet's queue gauges of the models the
batch's lines go to, where vLLM's run-batch serves its engine's (``vllm:num_requests_waiting``,
``vllm:num_requests_running``), with the workers' ``batchfleet_*`` queue gauges
(:mod:`.queue_gauges`). Read from Redis when scraped, at most once per :data:`CACHE_S`
(every scrape in between is answered from that read: several scrapers never add load), on
a connection of its own with short timeouts (a scrape during an outage is quick, and
shows none of them). The models are those the lines were sent to, their keys built by
:class:`~batchfleet.schemas.keys.ModelKeys`: no SCAN of a shared Redis's keys (costly
there, refused by a tight ACL), no ``bf:models`` (older workers never wrote it)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .connection import SyncClient, connect
from .fleetview import lane_counts
from .queue_gauges import queue_families, read_queues, vllm_families
from .redis_errors import FAILED_CALL

logger = logging.getLogger(__name__)

CACHE_S: Final = 2.0
"""Seconds one read of the queues answers the scrapes for."""
TIMEOUT_S: Final = 2.0
"""A scrape's connect and read timeouts (no retries): an outage costs a scrape this long."""
ENGINE: Final = "fleet"
"""The ``engine`` label of vLLM's gauges here: the fleet's totals, not one engine's."""


class FleetGauges(Collector):  # type: ignore[misc]
    """The queue gauges of the fleet models :meth:`use` named."""

    def __init__(self, redis_url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis_url = redis_url
        self.clock = clock
        self._named: set[str] = set()
        self._client: SyncClient | None = None
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._families: list[GaugeMetricFamily] = []

    def use(self, model: str) -> None:
        """A line's request goes to ``model``, one the fleet serves (the gateway's routing
        resolved the line's name: a ``--model-map`` alias, a LoRA adapter's base)."""
        self._named.add(model)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        with self._lock:  # (scrapes run on the server's threads: one reads, the others wait)
            if self.clock() - self._read_at >= CACHE_S:
                self._families = self._read()
                self._read_at = self.clock()
            return list(self._families)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _read(self) -> list[GaugeMetricFamily]:
        models = sorted(self._named.copy())  # (one C call: atomic beside the loop's adds)
        if not models:
            return []
        try:
            if self._client is None:  # (a cluster's client reads its slot map here)
                self._client = connect(self.redis_url, socket_timeout=TIMEOUT_S, retries=0,
                                       socket_connect_timeout=TIMEOUT_S)  # fmt: skip
            state = read_queues(self._client, lane_counts(self._client, models))
        except FAILED_CALL as exc:
            logger.warning("run-batch metrics: the fleet's queues unreadable: %s", exc)
            return []
        return [*vllm_families(state, ENGINE), *queue_families(state)]
