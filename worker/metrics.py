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
from .metric_children import Hist, Series
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
    """Feeds the :class:`~.metric_families.Metrics` families from the loop's events: a
    step's (the loop thread's) and a batch of results' (the sink's) at a few updates
    each, the same values as one update per event (:mod:`.metric_children`)."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.series = Series()

    def of(self, family: Any, *labels: str) -> Any:
        """``family.labels(*labels)``, looked up once: a generating model's every step sets
        a dozen series, and ``labels()`` costs more than setting one."""
        return self.series.count(family, *labels)

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, Generated):
            self._generated(event)
        elif isinstance(event, Dispatched):
            self._dispatched(event.model, event.batch)
        elif isinstance(event, BatchDone):
            inference, rows = self.series.group(("done", event.model), lambda: (
                self.series.hist(self.m.inference, event.model),
                self.of(self.m.rows, event.model)))  # fmt: skip
            inference.observe(event.seconds)
            rows.inc(event.batch.rows)
            if event.out_of_memory:
                self.of(self.m.oom, event.model).inc()
        elif isinstance(event, Answered):
            self._answered(event.model, event.replies)
        elif isinstance(event, DeadLettered):
            self.of(self.m.dead_letters, event.model, event.code).inc()

    def _generated(self, event: Generated) -> None:
        m, model, series = self.m, event.model, self.series
        running, waiting, kv_usage, compiling = series.group(("step", model), lambda: tuple(
            series.level(family, model) for family in (m.running, m.waiting, m.kv_usage,
                                                       m.compiling)))  # fmt: skip
        running.set(event.running)
        waiting.set(event.waiting)
        kv_usage.set(event.kv_tokens / max(1, event.kv_capacity))
        if event.preempted:
            self.of(m.preemptions, model).inc(event.preempted)
        if event.tokens:
            self.of(m.step_tokens, model).inc(event.tokens)
        if event.prefilled:
            self.of(m.step_prefill, model).inc(event.prefilled)
        if event.gaps:
            m.inter_token.add(model, event.gaps)
        if event.drafted[0]:
            self._speculated(model, event.drafted, event.accepted)
        if event.spec_skipped:
            self.of(m.spec_skipped, model).inc(event.spec_skipped)
        compiling.set(event.compiling)
        if event.compiled_s:
            series.hist(m.compile, model).observe_all(event.compiled_s)

    def _speculated(self, model: str, drafted: tuple[int, int], accepted: tuple[int, ...]) -> None:
        self.of(self.m.spec_drafts, model).inc(drafted[0])
        self.of(self.m.spec_draft_tokens, model).inc(drafted[1])
        self.of(self.m.spec_accepted, model).inc(sum(accepted))
        for position, n in enumerate(accepted):
            self.of(self.m.spec_accepted_per_pos, model, str(position)).inc(n)

    def _dispatched(self, model: str, batch: Batch) -> None:
        m, series = self.m, self.series
        self.of(m.batches, model, batch.reason).inc()
        rows, padded, waste = series.group(("dispatched", model), lambda: tuple(
            series.hist(family, model) for family in (m.batch_rows, m.padded_tokens,
                                                      m.padding_waste)))  # fmt: skip
        rows.observe(batch.rows)
        padded.observe(batch.padded_tokens)
        waste.observe(batch.padding_waste)

    def _answered(self, model: str, answered: Sequence[Reply]) -> None:
        """A batch of results: each series' values gathered, then updated once (series
        looked up in the order one update per result would create them)."""
        m = self.m
        counts: Tally[tuple[str, str]] = Tally()
        errors: Tally[str] = Tally()
        values: dict[Hist, list[float]] = {}
        generated = prompted = cached = 0
        used = detailed = False
        for a in answered:
            lane = str(a.lane)
            res = a.result
            counts[lane, res.status] += 1
            if res.error is not None:
                code = res.error.code
                errors[getattr(code, "value", code)] += 1
            t = res.timings
            latency, queue_wait, batch_wait = self._lane(model, lane)
            _gather(values, latency, t.total_ms / 1000)
            if res.status == "ok":
                _gather(values, queue_wait, t.queued_ms / 1000)
                _gather(values, batch_wait, t.batch_wait_ms / 1000)
            if t.first_token_ms is not None:
                first = self.series.hist(m.first_token, model, lane)
                _gather(values, first, t.first_token_ms / 1000)
            if res.usage is not None:
                used = True
                generated += res.usage.completion_tokens
                prompted += res.usage.prompt_tokens
                details = res.usage.prompt_tokens_details
                if details is not None:
                    detailed = True
                    cached += details.cached_tokens
        for code, n in errors.items():
            self.of(m.errors, model, code).inc(n)
        for hist, observed in values.items():
            hist.observe_all(observed)
        if used:
            self.of(m.generated_tokens, model).inc(generated)
            self.of(m.prompt_tokens, model).inc(prompted)
        if detailed:
            self.of(m.cached_tokens, model).inc(cached)
        for (lane, status), n in counts.items():
            self.of(m.results, model, lane, status).inc(n)

    def _lane(self, model: str, lane: str) -> tuple[Hist, Hist, Hist]:
        """A lane's latency, queue-wait and batch-wait series, made together."""
        hist, m = self.series.hist, self.m
        return self.series.group(("lane", model, lane), lambda: (
            hist(m.latency, model, lane), hist(m.queue_wait, model, lane),
            hist(m.batch_wait, model, lane)))  # fmt: skip


def _gather(values: dict[Hist, list[float]], hist: Hist, value: float) -> None:
    """Add ``value`` to those gathered for ``hist``."""
    found = values.get(hist)
    if found is None:
        values[hist] = [value]
    else:
        found.append(value)


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
