"""The fleet's queue state as Redis holds it: lanes, heartbeats, dead letters (read-only).

Shared by ``batchfleet status`` / ``top`` and the workers' ``/metrics`` collector. Torch-free
and Celery-free, so the CLI stays quick to start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .connection import SyncClient, execute_timed, timed_pipeline
from .schemas.keys import (
    GROUP,
    LANES_KEY_PATTERN,
    MODELS_KEY,
    ModelKeys,
    model_names,
    model_of_lanes_key,
)
from .schemas.model_info import ModelInfo, decode_model_info

DEFAULT_LANES = 3
"""Lanes assumed for a model whose lanes key is missing (the fleet file's default)."""


@dataclass(frozen=True, slots=True)
class LaneRow:
    """Depth of one lane, as read from Redis."""

    model: str
    lane: int
    length: int
    pending: int
    lag: int
    oldest_s: float


def discover_models(client: SyncClient) -> list[str]:
    """Every model some worker (or ``init-groups``) has announced on this Redis (by a SCAN
    of the lanes keys where no worker wrote the set of models: older ones)."""
    if names := model_names(client.smembers(MODELS_KEY)):
        return names
    found = set()
    for key in client.scan_iter(match=LANES_KEY_PATTERN, count=1000):
        model = model_of_lanes_key(_s(key))
        if model:
            found.add(model)
    return sorted(found)


def lane_counts(client: SyncClient, models: Sequence[str]) -> dict[str, int]:
    """Per model, its lane count from its lanes key (``DEFAULT_LANES`` when absent)."""
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.get(ModelKeys(model).lanes_key)
    return {m: int(v or DEFAULT_LANES) for m, v in zip(models, pipe.execute(), strict=True)}


def dead_letter_counts(client: SyncClient, models: Sequence[str]) -> dict[str, int]:
    """Per model, the length of its dead-letter stream."""
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.xlen(ModelKeys(model).dead)
    return {m: int(n) for m, n in zip(models, pipe.execute(), strict=True)}


def model_infos(client: SyncClient, models: Sequence[str]) -> dict[str, ModelInfo | None]:
    """Per model, what its workers published of it (None: nothing readable, older ones)."""
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.get(ModelKeys(model).info)
    found: dict[str, ModelInfo | None] = {}
    for model, raw in zip(models, pipe.execute(), strict=True):
        try:
            found[model] = decode_model_info(raw) if raw is not None else None
        except ValueError:
            found[model] = None
    return found


def read_lanes(client: SyncClient, models: dict[str, int]) -> list[LaneRow]:
    """Length, pending, lag and oldest age of every lane, in one pipelined round trip.

    Lag is ``XINFO GROUPS``' ``lag`` on Redis 7; on 6.2 (no lag field) it is length minus
    pending, which is exact here because answered entries are deleted from the stream.
    """
    pipe = timed_pipeline(client)
    order: list[tuple[str, int]] = []
    for model, lanes in models.items():
        for lane, stream in enumerate(ModelKeys(model).lanes(lanes)):
            order.append((model, lane))
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            pipe.xrange(stream, count=1)
    now, replies = execute_timed(client, pipe, raise_on_error=False)
    now_ms = _ms(now)
    out = []
    for i, (model, lane) in enumerate(order):
        length, groups, first = replies[3 * i : 3 + 3 * i]
        if isinstance(length, Exception):
            length = 0
        group: dict[str, Any] = {}
        if not isinstance(groups, Exception):
            group = next((g for g in groups if _s(g.get("name")) == GROUP), {})
        pending = int(group.get("pending") or 0)
        lag = group.get("lag")
        lag = int(lag) if lag is not None else max(0, int(length) - pending)
        oldest = 0.0
        if first and not isinstance(first, Exception):
            oldest = max(0.0, (now_ms - entry_ms(first[0][0])) / 1000)
        out.append(LaneRow(model, lane, int(length), pending, lag, oldest))
    return out


def heartbeats(client: SyncClient, models: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per model: consumer name → seconds since its last heartbeat (Redis clock)."""
    pipe = timed_pipeline(client)
    for model in models:
        pipe.hgetall(ModelKeys(model).workers)
    now, hashes = execute_timed(client, pipe)
    now_ms = _ms(now)
    return {
        model: {_s(k): max(0.0, (now_ms - int(v)) / 1000) for k, v in h.items()}
        for model, h in zip(models, hashes, strict=True)
    }


def live_workers(
    client: SyncClient, models: Sequence[str], fresh_ms: int = 10_000
) -> dict[str, int]:
    """Per model, how many consumers sent a heartbeat within ``fresh_ms``."""
    beats = heartbeats(client, models)
    return {m: sum(age <= fresh_ms / 1000 for age in ws.values()) for m, ws in beats.items()}


def entry_ms(entry_id: bytes | str) -> int:
    """Unix ms at which a stream entry was added (the time part of its id)."""
    return int(_s(entry_id).split("-", 1)[0])


def _ms(redis_time: Sequence[int]) -> float:
    sec, usec = redis_time
    return sec * 1000 + usec / 1000


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
