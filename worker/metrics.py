"""Prometheus ``/metrics`` of one worker process (``prometheus-client``).

Histograms and counters (their families: :mod:`.metric_families`) are fed by
:class:`PrometheusObserver` on the loop thread (cheap in-memory updates). Queue state —
stream length, pending, consumer-group lag and the age of the oldest waiting request per
lane — is read from Redis at scrape time by :class:`StreamCollector`, so it is fresh and
costs nothing between scrapes. Every worker reports the same queue gauges: aggregate them
with ``max by (model, lane)``. Flower's own ``/metrics`` covers the task events
(``flower_events_total`` …).
"""

from __future__ import annotations

import errno
import logging
import sys
from collections import Counter as Tally
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..batching.types import Batch
from ..config import FleetConfig, MetricsConfig
from ..connection import SyncClient, connect
from ..queue_gauges import queue_families, read_queues
from .lora_metrics import LoraCollector
from .metric_families import Metrics
from .observers import (
    Answered,
    BatchDone,
    DeadLettered,
    Dispatched,
    Generated,
    LoopEvent,
    LoopObserver,
    NullObserver,
    Observers,
    Reply,
)
from .runners import BUILTIN
from .vllm_info import VllmInfoCollector
from .vllm_metrics import VllmMetrics, VllmObserver

logger = logging.getLogger(__name__)


class PrometheusObserver:
    """Feeds the :class:`~.metric_families.Metrics` families from the loop's events."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self._children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._child: dict[tuple[int, tuple[str, ...]], Any] = {}
        """(family id, label values) -> its child (see :meth:`of`)."""

    def of(self, family: Any, *labels: str) -> Any:
        """``family.labels(*labels)``, looked up once: a generating model's every step sets
        a dozen series, and ``labels()`` costs more than setting one."""
        key = (id(family), labels)
        child = self._child.get(key)
        if child is None:
            child = self._child[key] = family.labels(*labels)
        return child

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, Dispatched):
            self._dispatched(event.model, event.batch)
        elif isinstance(event, BatchDone):
            self.of(self.m.inference, event.model).observe(event.seconds)
            self.of(self.m.rows, event.model).inc(event.batch.rows)
            if event.out_of_memory:
                self.of(self.m.oom, event.model).inc()
        elif isinstance(event, Answered):
            self._answered(event.model, event.replies)
        elif isinstance(event, DeadLettered):
            self.m.dead_letters.labels(event.model, event.code).inc()
        elif isinstance(event, Generated):
            self.of(self.m.running, event.model).set(event.running)
            self.of(self.m.waiting, event.model).set(event.waiting)
            self.of(self.m.kv_usage, event.model).set(event.kv_tokens / max(1, event.kv_capacity))
            if event.preempted:
                self.of(self.m.preemptions, event.model).inc(event.preempted)
            if event.tokens:
                self.of(self.m.step_tokens, event.model).inc(event.tokens)
            if event.prefilled:
                self.of(self.m.step_prefill, event.model).inc(event.prefilled)
            if event.gaps:
                self.m.inter_token.add(event.model, event.gaps)
            if event.drafted[0]:
                self._speculated(event.model, event.drafted, event.accepted)
            if event.spec_skipped:
                self.of(self.m.spec_skipped, event.model).inc(event.spec_skipped)
            self.of(self.m.compiling, event.model).set(event.compiling)
            if event.compiled_s:
                compile_ = self.of(self.m.compile, event.model)
                for seconds in event.compiled_s:
                    compile_.observe(seconds)

    def _speculated(self, model: str, drafted: tuple[int, int], accepted: tuple[int, ...]) -> None:
        self.of(self.m.spec_drafts, model).inc(drafted[0])
        self.of(self.m.spec_draft_tokens, model).inc(drafted[1])
        self.of(self.m.spec_accepted, model).inc(sum(accepted))
        for position, n in enumerate(accepted):
            self.of(self.m.spec_accepted_per_pos, model, str(position)).inc(n)

    def _dispatched(self, model: str, batch: Batch) -> None:
        self.of(self.m.batches, model, batch.reason).inc()
        self.of(self.m.batch_rows, model).observe(batch.rows)
        self.of(self.m.padded_tokens, model).observe(batch.padded_tokens)
        self.of(self.m.padding_waste, model).observe(batch.padding_waste)

    def _answered(self, model: str, answered: Sequence[Reply]) -> None:
        counts: Tally[tuple[str, str]] = Tally()
        for a in answered:
            lane = str(a.lane)
            res = a.result
            counts[lane, res.status] += 1
            if res.error is not None:
                code = res.error.code
                self.m.errors.labels(model, getattr(code, "value", code)).inc()
            t = res.timings
            latency, queue_wait, batch_wait = self._lane(model, lane)
            latency.observe(t.total_ms / 1000)
            if res.status == "ok":
                queue_wait.observe(t.queued_ms / 1000)
                batch_wait.observe(t.batch_wait_ms / 1000)
            if t.first_token_ms is not None:
                self.m.first_token.labels(model, lane).observe(t.first_token_ms / 1000)
            if res.usage is not None:
                self.m.generated_tokens.labels(model).inc(res.usage.completion_tokens)
                self.m.prompt_tokens.labels(model).inc(res.usage.prompt_tokens)
                details = res.usage.prompt_tokens_details
                if details is not None:
                    self.m.cached_tokens.labels(model).inc(details.cached_tokens)
        for (lane, status), n in counts.items():
            self.m.results.labels(model, lane, status).inc(n)

    def _lane(self, model: str, lane: str) -> tuple[Any, Any, Any]:
        """The per-lane histogram children (label lookups cost more than observing)."""
        key = (model, lane)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = (
                self.m.latency.labels(model, lane),
                self.m.queue_wait.labels(model, lane),
                self.m.batch_wait.labels(model, lane),
            )
        return found


class StreamCollector(Collector):  # type: ignore[misc]
    """Queue gauges per model and lane, read from Redis at each scrape (one round trip)."""

    def __init__(self, client: SyncClient, models: dict[str, int]) -> None:
        self.client = client
        self.models = models  # model -> lanes
        self.up = True

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            state = read_queues(self.client, self.models)
        except redis.RedisError as exc:
            logger.warning("metrics: redis unreachable: %s", exc)
            return
        yield from queue_families(state)
        yield from _device_memory()


def _device_memory() -> Iterator[GaugeMetricFamily]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    allocated = GaugeMetricFamily(
        "batchfleet_device_memory_allocated_bytes", "CUDA memory allocated.", labels=["device"]
    )
    reserved = GaugeMetricFamily(
        "batchfleet_device_memory_reserved_bytes", "CUDA memory reserved.", labels=["device"]
    )
    for i in range(torch.cuda.device_count()):
        allocated.add_metric([f"cuda:{i}"], torch.cuda.memory_allocated(i))
        reserved.add_metric([f"cuda:{i}"], torch.cuda.memory_reserved(i))
    yield allocated
    yield reserved


def worker_loops(worker: Any) -> list[Any]:
    """The batch loops of a Celery worker (its blueprint steps')."""
    return [lp for step in getattr(worker, "steps", ()) for lp in getattr(step, "loops", ())]


class MetricsServer:
    """One ``/metrics`` HTTP server per worker process, shared by its models' observers."""

    def __init__(self, fleet: FleetConfig, models: dict[str, int]) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.metrics = Metrics(self.registry)
        self.vllm = VllmMetrics(self.registry) if fleet.metrics.vllm else None
        for model, lanes in models.items():
            self.metrics.init_model(model, lanes)
        self.client = connect(fleet.redis_url, socket_timeout=5.0)
        self.registry.register(StreamCollector(self.client, models))
        self.port = self._serve(fleet.metrics)
        self.url = f"http://{fleet.metrics.address}:{self.port}/metrics"

    def _serve(self, cfg: MetricsConfig) -> int:
        try:
            server, _ = start_http_server(cfg.port, cfg.address, registry=self.registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            server, _ = start_http_server(0, cfg.address, registry=self.registry)
            logger.warning(
                "metrics port %d is taken; serving /metrics on port %d instead",
                cfg.port,
                server.server_port,
            )
        self._server = server
        logger.info("serving /metrics on %s:%d", cfg.address, server.server_port)
        return int(server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self.client.close()


def prometheus_metrics(worker: Any, fleet: FleetConfig, model: str) -> LoopObserver:
    """Observer factory for ``app.batchfleet_observers``: starts the worker's server once."""
    if not fleet.metrics.enabled:
        return NullObserver()
    server = getattr(worker, "_batchfleet_metrics", None)
    if server is None:
        only = worker.app.batchfleet_models or list(fleet.models)
        server = MetricsServer(fleet, {m: fleet.models[m].lanes for m in only})
        server.registry.register(LoraCollector(lambda: worker_loops(worker)))
        if server.vllm is not None:
            server.registry.register(VllmInfoCollector(lambda: worker_loops(worker)))
        worker._batchfleet_metrics = server
    observer = PrometheusObserver(server.metrics)
    runner = fleet.models[model].runner
    if server.vllm is None or (runner in BUILTIN and runner != "text-generation"):
        return observer  # an encoder: no vLLM metrics (a custom runner may generate)
    generating = runner == "text-generation"
    return Observers([observer, VllmObserver(server.vllm, model, generating)])
