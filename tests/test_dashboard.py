"""The Grafana dashboard only queries series the workers, the gateway (or Flower) export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from batchfleet.producer.gateway.metrics import GatewayMetrics
from batchfleet.worker.metrics import Metrics
from prometheus_client import CollectorRegistry

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "batchfleet.json"
GAUGES = {
    "batchfleet_stream_length",
    "batchfleet_stream_pending",
    "batchfleet_stream_lag",
    "batchfleet_oldest_waiting_seconds",
    "batchfleet_model_workers",
    "batchfleet_device_memory_allocated_bytes",
    "batchfleet_device_memory_reserved_bytes",
}


def test_dashboard_queries_exported_series() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    gateway = GatewayMetrics()
    gateway.watch(lambda: 0, lambda: 1)
    exported = set(GAUGES)
    for family in [*registry.collect(), *gateway.registry.collect()]:
        if family.type == "gauge":
            exported.add(family.name)
            continue
        suffixes = ("_bucket", "_sum", "_count") if family.type == "histogram" else ("_total",)
        exported |= {family.name + s for s in suffixes}
    dash = json.loads(DASHBOARD.read_text())
    used = {
        name
        for panel in dash["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bbatchfleet_[a-z_]+", target["expr"])
    }
    assert used, "the dashboard has queries"
    assert used <= exported, used - exported
