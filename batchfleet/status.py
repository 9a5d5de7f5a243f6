"""``batchfleet status`` (one table) and ``batchfleet top`` (live): the fleet at a glance.

Queue state comes from Redis alone (lane streams, the consumer group, the workers'
heartbeat hash, the dead-letter stream), so it works with no worker running. Per-worker
throughput, error ratio and state come from ``celery inspect stats`` when workers answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .connection import connect
from .schemas.keys import LANES_KEY_PATTERN, ModelKeys, model_of_lanes_key
from .worker.metrics import LaneRow, heartbeats, read_lanes

STALE_S = 10.0
"""A worker whose heartbeat is older than this is shown as stale."""


@dataclass
class ModelStatus:
    model: str
    lanes: list[LaneRow]
    workers: dict[str, float]
    """Consumer name → seconds since its heartbeat."""
    dead_letters: int


@dataclass
class FleetStatus:
    models: list[ModelStatus]
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Celery hostname → its ``inspect stats`` ``batchfleet`` section (model → info)."""


def discover_models(client: redis.Redis) -> list[str]:
    """Every model some worker has served on this Redis (from the lanes keys)."""
    found = set()
    for key in client.scan_iter(match=LANES_KEY_PATTERN, count=1000):
        model = model_of_lanes_key(key.decode() if isinstance(key, bytes) else key)
        if model:
            found.add(model)
    return sorted(found)


def collect(client: redis.Redis, models: Sequence[str] | None = None) -> list[ModelStatus]:
    """Depths, lag and oldest age per lane; live consumers; dead letters; per model."""
    names = list(models) if models else discover_models(client)
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for m in names:
        keys = ModelKeys(m)
        pipe.get(keys.lanes_key)
        pipe.xlen(keys.dead)
    replies = pipe.execute()
    lanes = {m: int(replies[2 * i] or 3) for i, m in enumerate(names)}
    dead = {m: int(replies[2 * i + 1]) for i, m in enumerate(names)}
    rows = read_lanes(client, lanes)
    beats = heartbeats(client, names)
    return [ModelStatus(m, [r for r in rows if r.model == m], beats[m], dead[m]) for m in names]


def inspect_workers(redis_url: str, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
    """``celery inspect stats`` of every batchfleet worker that answers within ``timeout``."""
    from celery import Celery

    app = Celery("batchfleet-status", broker=redis_url, set_as_current=False)
    app.conf.update(accept_content=["json", "msgpack"], event_serializer="json")
    try:
        replies = app.control.inspect(timeout=timeout).stats() or {}
    finally:
        app.close()
    return {host: info["batchfleet"] for host, info in replies.items() if "batchfleet" in info}


def gather(
    redis_url: str, models: Sequence[str] | None = None, *, workers: bool = True
) -> FleetStatus:
    client = connect(redis_url)
    try:
        status = FleetStatus(collect(client, models))
    finally:
        client.close()
    if workers:
        status.workers = inspect_workers(redis_url)
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
    for col in ("model", "lane", "depth", "pending", "lag", "oldest", "dead letters"):
        streams.add_column(col, justify="left" if col == "model" else "right")
    for ms in status.models:
        for i, row in enumerate(ms.lanes):
            streams.add_row(
                ms.model if i == 0 else "",
                str(row.lane),
                str(row.length),
                str(row.pending),
                str(row.lag),
                _age(row.oldest_s) if row.length else "-",
                str(ms.dead_letters) if i == 0 else "",
            )
    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "model", "state", "req/s (1m)", "errors", "batches", "mean rows",
                "heartbeat"):  # fmt: skip
        workers.add_column(col, justify="left" if col in ("worker", "model", "state") else "right")
    by_consumer: dict[tuple[str, str], dict[str, Any]] = {}
    for host, models in status.workers.items():
        for model, info in models.items():
            by_consumer[(info.get("consumer", host), model)] = info
    for ms in status.models:
        for name, age in sorted(ms.workers.items()):
            info = by_consumer.get((name, ms.model), {})
            state = info.get("state", "?") if age <= STALE_S else "stale"
            workers.add_row(
                name,
                ms.model,
                state,
                f"{info['requests_per_s']:.1f}" if "requests_per_s" in info else "-",
                f"{info['error_ratio']:.1%}" if "error_ratio" in info else "-",
                str(info.get("batches", "-")),
                str(info.get("mean_batch_rows", "-")),
                _age(age) + " ago",
            )
    if not status.models:
        return Group("no models found on this Redis (no worker has started yet)")
    return Group(streams, workers)


def print_status(
    redis_url: str,
    models: Sequence[str] | None = None,
    *,
    workers: bool = True,
    console: Console | None = None,
) -> FleetStatus:
    """``batchfleet status``: print the tables once."""
    status = gather(redis_url, models, workers=workers)
    (console or Console()).print(render(status))
    return status


def top(
    redis_url: str,
    models: Sequence[str] | None = None,
    *,
    interval: float = 2.0,
    iterations: int | None = None,
) -> None:
    """``batchfleet top``: the same tables, refreshed every ``interval`` seconds."""
    done = 0
    with Live(render(gather(redis_url, models)), refresh_per_second=4, screen=False) as live:
        while iterations is None or done < iterations:
            time.sleep(interval)
            live.update(render(gather(redis_url, models)))
            done += 1
