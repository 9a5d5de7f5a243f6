"""Operators' view of a model's dead-letter stream: list, replay, purge.

A replay goes through ``lua/replay.lua``: like a producer's submit it respects the lane's
maximum depth, and it moves the entry atomically (no copy left behind, none lost).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from .connection import SyncClient
from .schemas.codec import envelope_of
from .schemas.keys import ModelKeys

REPLAY_LUA = (
    importlib.resources.files(__package__).joinpath("lua").joinpath("replay.lua").read_text()
)

ORIG = b"orig_"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead-letter entry: where it came from, why, and the original entry."""

    id: str
    source: str
    source_id: str
    code: str
    reason: str
    worker: str
    original: dict[bytes, bytes] = field(repr=False)

    @property
    def request_id(self) -> str | None:
        return envelope_of(self.original).id

    def to_json(self) -> dict[str, Any]:
        """What ``batchfleet dlq list --json`` prints for it (full ids, no original body)."""
        return {
            "id": self.id,
            "request_id": self.request_id,
            "code": self.code,
            "reason": self.reason,
            "source": self.source,
            "source_id": self.source_id,
            "worker": self.worker,
        }


def _parse(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    def text(name: bytes) -> str:
        return fields.get(name, b"").decode(errors="replace")

    return DeadLetter(
        id=entry_id.decode(),
        source=text(b"source"),
        source_id=text(b"source_id"),
        code=text(b"code"),
        reason=text(b"reason"),
        worker=text(b"worker"),
        original={k[len(ORIG) :]: v for k, v in fields.items() if k.startswith(ORIG)},
    )


def list_dead(client: SyncClient, model: str, count: int = 100) -> list[DeadLetter]:
    """The oldest ``count`` dead letters of ``model``."""
    found: Any = client.xrange(ModelKeys(model).dead, count=count)
    return [_parse(i, f) for i, f in found]


def _select(client: SyncClient, model: str, ids: Sequence[str] | None) -> list[DeadLetter]:
    key = ModelKeys(model).dead
    if ids is None:
        every: Any = client.xrange(key)
        return [_parse(i, f) for i, f in every]
    out = []
    for entry_id in ids:
        found: Any = client.xrange(key, entry_id, entry_id)
        if not found:
            raise KeyError(f"no dead letter {entry_id} for model {model!r}")
        out.append(_parse(*found[0]))
    return out


@dataclass
class ReplayReport:
    replayed: list[str] = field(default_factory=list)
    """Dead-letter ids put back on their lane (new entries)."""
    skipped: list[str] = field(default_factory=list)
    """Dead-letter ids left alone: their request already has a result (use ``force``)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Dead-letter id → why it stayed: its lane is full (max depth), or it has no lane."""


def replay(
    client: SyncClient, model: str, ids: Sequence[str] | None = None, *, force: bool = False
) -> ReplayReport:
    """Put dead letters back on the lane they came from, as new entries, while the lane is
    below its maximum depth; the others stay dead letters (``report.refused`` says why).

    A request that was answered (say with a ``poisoned`` error) keeps that result unless
    ``force`` deletes it first, so the replay can store a new one.
    """
    keys = ModelKeys(model)
    script = client.register_script(REPLAY_LUA)
    report = ReplayReport()
    for dead in _select(client, model, ids):
        lane = keys.lane_of(dead.source)
        if lane is None or not dead.original:
            report.refused[dead.id] = (
                f"its source {dead.source!r} is not a lane of {model!r}"
                if lane is None
                else "it holds no original entry"
            )
            continue
        rid = dead.request_id
        script_keys = [keys.lane(lane), keys.max_depth, keys.dead]
        if rid is not None:
            script_keys.append(keys.result(rid))
        flat = [part for item in dead.original.items() for part in item]
        try:
            verdict, _ = script(keys=script_keys, args=[dead.id, int(force), *flat])
        except redis.ResponseError as exc:
            if not str(exc).startswith("QUEUEFULL"):
                raise
            report.refused[dead.id] = f"lane {lane} is full: {exc}"
            continue
        verdict = verdict.decode() if isinstance(verdict, bytes) else verdict
        if verdict == "replayed":
            report.replayed.append(dead.id)
        elif verdict == "answered":
            report.skipped.append(dead.id)
    return report


def purge(client: SyncClient, model: str, ids: Sequence[str] | None = None) -> int:
    """Delete dead letters (all when ``ids`` is None); returns how many."""
    key = ModelKeys(model).dead
    if ids is None:
        count = int(client.xlen(key))
        client.delete(key)
        return count
    return int(client.xdel(key, *ids)) if ids else 0
