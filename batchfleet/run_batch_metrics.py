"""``batchfleet run-batch --enable-metrics``: run-batch's own Prometheus metrics, served at
``--url``/``--port`` while the run lasts (vLLM's run-batch starts prometheus-client's
``start_http_server(port=args.port, addr=args.url)``). vLLM's serves its engine's metrics;
a run-batch here runs no model, so it serves what the batch saw (lines read, answered by
status and code, in flight, ``queue_full`` retries, each line's latency, Redis reachable)
and the fleet's queue gauges of the models its lines go to (:mod:`.run_batch_fleet`). The
model metrics are the workers' ``/metrics``, the gateway's its own."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from .producer.gateway.metrics import LATENCY_BUCKETS
from .run_batch_fleet import FleetGauges

DEFAULT_URL: Final = "0.0.0.0"
DEFAULT_PORT: Final = 8000
"""vLLM's run-batch ``--url`` and ``--port`` defaults."""


class RunBatchMetrics:
    """One run's metric families, in their own registry (runs in one process: tests);
    ``clock``: the fleet gauges' cache's."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.read = Counter(
            "batchfleet_run_batch_lines_read", "Input lines read (blank lines skipped)",
            registry=r,
        )  # fmt: skip
        self.answered = Counter(
            "batchfleet_run_batch_lines_answered", "Output lines, by the status_code they "
            "carry and their error's code (empty: answered, 200)", ["status", "code"],
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "batchfleet_run_batch_lines_in_flight", "Lines sent to the fleet and not yet "
            "answered", registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "batchfleet_run_batch_queue_full_retries", "Lines sent again after the fleet "
            "refused them as queue_full (its lanes full)", registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "batchfleet_run_batch_line_duration_seconds", "A line sent → its answer (its "
            "queue_full waits included)", buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.redis_reachable = Gauge(
            "batchfleet_run_batch_redis_reachable", "1 while Redis answers run-batch's "
            "pings, 0 during an outage", registry=r,
        )  # fmt: skip
        self.fleet: FleetGauges | None = None
        """The fleet's queue gauges while a run lasts (:meth:`watch_fleet`)."""

    def watch_fleet(self, redis_url: str) -> FleetGauges:
        """Serve the fleet's queue gauges, read from ``redis_url``, until :meth:`unwatch_fleet`."""
        self.fleet = FleetGauges(redis_url, self.clock)
        self.registry.register(self.fleet)
        return self.fleet

    def unwatch_fleet(self) -> None:
        if self.fleet is not None:
            self.registry.unregister(self.fleet)
            self.fleet.close()
            self.fleet = None

    def line(self, status: int, error: dict[str, object] | None) -> None:
        """One output line written with ``status`` and OpenAI's error object (or None)."""
        inner = error.get("error") if error else None
        code = inner.get("code") if isinstance(inner, dict) else None
        self.answered.labels(str(status), str(code or "")).inc()


class MetricsServer:
    """prometheus-client's HTTP server of one run's registry, on a thread, until closed."""

    def __init__(self, metrics: RunBatchMetrics, url: str, port: int) -> None:
        self._server, self._thread = start_http_server(port, url, registry=metrics.registry)
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
