"""The fleet's queue gauges as Prometheus families, read from Redis in one go: per lane its
length, pending, lag and oldest request's age, per model its live workers and dead
letters (the workers' ``/metrics``, :class:`~batchfleet.worker.metrics.StreamCollector`),
and vLLM's ``vllm:num_requests_waiting`` / ``vllm:num_requests_running`` of a model as the
fleet's sums (run-batch's ``/metrics``, where vLLM's run-batch shows its engine's)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

from . import fleetview
from .connection import SyncClient


@dataclass(frozen=True, slots=True)
class QueueState:
    """What Redis holds of some models' queues."""

    rows: list[fleetview.LaneRow]
    workers: dict[str, int]
    """Model → workers with a fresh heartbeat."""
    dead_letters: dict[str, int]


def read_queues(client: SyncClient, models: dict[str, int]) -> QueueState:
    """The queues of ``models`` (model → its lane count); raises what the client raises."""
    names = list(models)
    return QueueState(fleetview.read_lanes(client, models),
                      fleetview.live_workers(client, names),
                      fleetview.dead_letter_counts(client, names))  # fmt: skip


def queue_families(state: QueueState) -> list[GaugeMetricFamily]:
    """The ``batchfleet_*`` queue gauges: by model and lane, then by model."""
    per_lane = {
        "length": GaugeMetricFamily("batchfleet_stream_length", "Entries in a lane stream "
                                    "(its backlog).", labels=["model", "lane"]),
        "pending": GaugeMetricFamily("batchfleet_stream_pending", "Entries read by a worker "
                                     "and not yet answered.", labels=["model", "lane"]),
        "lag": GaugeMetricFamily("batchfleet_stream_lag", "Entries no worker has read yet "
                                 "(consumer-group lag).", labels=["model", "lane"]),
        "oldest_s": GaugeMetricFamily("batchfleet_oldest_waiting_seconds", "Age of the oldest "
                                      "unanswered request in a lane.", labels=["model", "lane"]),
    }  # fmt: skip
    for row in state.rows:
        for field, family in per_lane.items():
            family.add_metric([row.model, str(row.lane)], getattr(row, field))
    workers = GaugeMetricFamily("batchfleet_model_workers", "Workers with a fresh heartbeat.",
                                labels=["model"])  # fmt: skip
    for model, n in state.workers.items():
        workers.add_metric([model], n)
    dead = GaugeMetricFamily("batchfleet_dead_letter_stream_length", "Entries in a model's "
                             "dead-letter stream (until replayed or purged).", labels=["model"])  # fmt: skip
    for model, n in state.dead_letters.items():
        dead.add_metric([model], n)
    return [*per_lane.values(), workers, dead]


def vllm_families(state: QueueState, engine: str) -> list[GaugeMetricFamily]:
    """vLLM's request gauges of each model over the whole fleet (labels ``model_name``,
    ``engine``): waiting, the requests no worker has read (the lanes' lag); running, those
    read and not answered (pending: in a batch, or held by a worker for its next)."""
    labels = ["model_name", "engine"]
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to "
                                "be processed.", labels=labels)  # fmt: skip
    running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model "
                                "execution batches.", labels=labels)  # fmt: skip
    for model in state.workers:
        rows = [row for row in state.rows if row.model == model]
        waiting.add_metric([model, engine], sum(row.lag for row in rows))
        running.add_metric([model, engine], sum(row.pending for row in rows))
    return [waiting, running]
