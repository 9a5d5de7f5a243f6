"""Create every model's consumer groups and lanes key ahead of the first worker.

Run at deploy time (``batchfleet init-groups --config fleet.toml``, a Kubernetes Job) so
that autoscalers reading a group's lag or pending count (KEDA's redis-streams scaler) see
the groups while no worker runs yet, and producers see each model's lane count.
Idempotent: workers do the same on start.
"""

from __future__ import annotations

import logging

from .config import FleetConfig
from .connection import connect
from .worker.streams import ModelStreams

logger = logging.getLogger(__name__)


def init_groups(fleet: FleetConfig, models: list[str] | None = None) -> dict[str, list[str]]:
    """Ensure the group on each lane stream of each model; return model → its lane streams."""
    names = models or list(fleet.models)
    unknown = sorted(set(names) - set(fleet.models))
    if unknown:
        raise KeyError(f"not in the fleet file: {unknown} (it has {sorted(fleet.models)})")
    client = connect(fleet.redis_url)
    try:
        created: dict[str, list[str]] = {}
        for name in names:
            cfg = fleet.models[name]
            streams = ModelStreams(client, name, cfg.lanes, consumer="init-groups")
            streams.ensure_groups(cfg.max_queue_depth, cfg.limits,
                                  heartbeat_timeout_ms=fleet.worker.heartbeat_timeout_ms)  # fmt: skip
            created[name] = streams.streams
            logger.info("model %s: group ready on %s", name, ", ".join(streams.streams))
        return created
    finally:
        client.close()
