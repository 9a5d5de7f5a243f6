"""``batchfleet status`` (one table; ``batchfleet top`` shows it live, :mod:`.top`): the
fleet at a glance.

Queue state comes from Redis alone (lane streams, the consumer group, the workers'
heartbeat hash, the dead-letter stream), so it works with no worker running. Per-worker
throughput, answered requests by status (ok, error, expired) and state come from ``celery
inspect stats`` when workers answer; a worker shows as its Celery hostname then, which
``-d`` takes (a bare ``--name`` works there too).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from .connection import SyncClient, connect
from .fleetview import (
    LaneRow,
    dead_letter_counts,
    discover_models,
    heartbeats,
    lane_counts,
    model_infos,
    read_lanes,
)
from .remote import inspect_stats
from .schemas.model_info import ModelInfo

STALE_S = 10.0
"""A worker whose heartbeat is older than this is shown as stale."""
STATUS_COLUMNS = {"ok": "ok", "errors": "error", "expired": "expired"}
"""Column → the result status it counts (expired apart from errors: a capacity problem)."""


@dataclass
class ModelStatus:
    model: str
    lanes: list[LaneRow]
    workers: dict[str, float]
    """Consumer name → seconds since its heartbeat."""
    dead_letters: int
    info: ModelInfo | None = None
    """What its workers published of it (task, context length); None: older workers."""


@dataclass
class FleetStatus:
    models: list[ModelStatus]
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Celery hostname → its ``inspect stats`` ``batchfleet`` section (model → info)."""

    def worker_rows(self) -> list[dict[str, Any]]:
        """One row per (worker, model): heartbeat from Redis, the rest from ``inspect stats``.
        ``worker`` is the Celery hostname when the worker answered (a ``-d`` destination),
        else its consumer name (which ``-d`` accepts too)."""
        by_consumer: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        for host, models in self.workers.items():
            for model, info in models.items():
                by_consumer[(info.get("consumer", host), model)] = (host, info)
        rows = []
        for ms in self.models:
            for name, age in sorted(ms.workers.items()):
                host, info = by_consumer.get((name, ms.model), (name, {}))
                requests = info.get("requests", {})
                gen = info.get("generation") or {}
                rows.append(
                    {
                        "worker": host,
                        "consumer": name,
                        "model": ms.model,
                        "state": info.get("state", "?") if age <= STALE_S else "stale",
                        "requests_per_s": info.get("requests_per_s"),
                        **{
                            column: requests.get(status, 0) if info else None
                            for column, status in STATUS_COLUMNS.items()
                        },
                        "batches": info.get("batches"),
                        "mean_batch_rows": info.get("mean_batch_rows"),
                        "running": gen.get("running_sequences"),
                        "tokens_per_s": info.get("tokens_per_s"),
                        "kv_cache_usage": gen.get("kv_cache_usage"),
                        "spec_acceptance": gen.get("spec_acceptance"),
                        "heartbeat_age_s": round(age, 3),
                    }
                )
        return rows

    def to_json(self) -> dict[str, Any]:
        """What ``batchfleet status --json`` prints."""
        return {
            "models": [
                {
                    "model": ms.model,
                    "dead_letters": ms.dead_letters,
                    "task": ms.info.task if ms.info else None,
                    "max_model_len": ms.info.max_model_len if ms.info else None,
                    "lora_adapters": ms.info.lora_adapters if ms.info else [],
                    "lanes": [
                        {k: v for k, v in asdict(row).items() if k != "model"} for row in ms.lanes
                    ],
                }
                for ms in self.models
            ],
            "workers": self.worker_rows(),
        }


def collect(client: SyncClient, models: Sequence[str] | None = None) -> list[ModelStatus]:
    """Depths, lag and oldest age per lane; live consumers; dead letters; per model."""
    names = list(models) if models else discover_models(client)
    if not names:
        return []
    rows = read_lanes(client, lane_counts(client, names))
    beats = heartbeats(client, names)
    dead = dead_letter_counts(client, names)
    infos = model_infos(client, names)
    return [
        ModelStatus(m, [r for r in rows if r.model == m], beats[m], dead[m], infos[m])
        for m in names
    ]


def gather(
    redis_url: str,
    models: Sequence[str] | None = None,
    *,
    workers: bool = True,
    broker_url: str | None = None,
    socket_timeout: float | None = 15.0,
    retries: int = 3,
) -> FleetStatus:
    """Queue state from ``redis_url`` (each call bounded by ``socket_timeout``, tried
    ``retries`` more times); worker stats through ``broker_url`` (default the same)."""
    client = connect(redis_url, socket_timeout=socket_timeout, retries=retries)
    try:
        status = FleetStatus(collect(client, models))
    finally:
        client.close()
    if workers:
        status.workers = inspect_stats(broker_url or redis_url)
    return status


def _age(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.0f}m"


def render(status: FleetStatus) -> Group:
    """Two tables: streams per model and lane, then workers."""
    streams = Table(title="streams", title_justify="left")
    for col in ("model", "task", "context", "lane", "depth", "pending", "lag", "oldest",
                "dead letters"):  # fmt: skip
        streams.add_column(col, justify="left" if col in ("model", "task") else "right")
    for ms in status.models:
        task = ms.info.task if ms.info else "-"
        context = str(ms.info.max_model_len) if ms.info and ms.info.max_model_len else "-"
        for i, row in enumerate(ms.lanes):
            streams.add_row(
                ms.model if i == 0 else "",
                task if i == 0 else "",
                context if i == 0 else "",
                str(row.lane),
                str(row.length),
                str(row.pending),
                str(row.lag),
                _age(row.oldest_s) if row.length else "-",
                str(ms.dead_letters) if i == 0 else "",
            )
    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "model", "state", "req/s (1m)", "ok", "errors", "expired", "batches",
                "mean rows", "running", "tok/s (1m)", "kv cache", "spec accept", "heartbeat"):  # fmt: skip
        workers.add_column(col, justify="left" if col in ("worker", "model", "state") else "right")
    for w in status.worker_rows():
        rate = w["requests_per_s"]
        workers.add_row(
            w["worker"],
            w["model"],
            w["state"],
            "-" if rate is None else f"{rate:.1f}",
            *("-" if w[k] is None else str(w[k]) for k in ("ok", "errors", "expired", "batches")),
            "-" if w["mean_batch_rows"] is None else str(w["mean_batch_rows"]),
            "-" if w["running"] is None else str(w["running"]),
            "-" if w["tokens_per_s"] is None else f"{w['tokens_per_s']:.1f}",
            "-" if w["kv_cache_usage"] is None else f"{w['kv_cache_usage']:.0%}",
            "-" if w["spec_acceptance"] is None else f"{w['spec_acceptance']:.0%}",
            _age(w["heartbeat_age_s"]) + " ago",
        )
    if not status.models:
        return Group("no models found on this Redis (no worker has started yet)")
    return Group(streams, workers)


def print_status(
    redis_url: str,
    models: Sequence[str] | None = None,
    *,
    workers: bool = True,
    broker_url: str | None = None,
    console: Console | None = None,
    as_json: bool = False,
) -> FleetStatus:
    """``batchfleet status``: print the tables (or one JSON document) once."""
    status = gather(redis_url, models, workers=workers, broker_url=broker_url)
    out = console or Console()
    if as_json:
        out.out(json.dumps(status.to_json(), indent=2), highlight=False)
    else:
        out.print(render(status))
    return status
