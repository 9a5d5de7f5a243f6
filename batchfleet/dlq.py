"""Operators' view of a model's dead-letter stream: list, replay, purge."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from .schemas.codec import envelope_of
from .schemas.keys import ModelKeys

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


def list_dead(client: redis.Redis, model: str, count: int = 100) -> list[DeadLetter]:
    """The oldest ``count`` dead letters of ``model``."""
    return [_parse(i, f) for i, f in client.xrange(ModelKeys(model).dead, count=count)]


def _select(client: redis.Redis, model: str, ids: Sequence[str] | None) -> list[DeadLetter]:
    key = ModelKeys(model).dead
    if ids is None:
        return [_parse(i, f) for i, f in client.xrange(key)]
    out = []
    for entry_id in ids:
        found = client.xrange(key, entry_id, entry_id)
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


def replay(
    client: redis.Redis, model: str, ids: Sequence[str] | None = None, *, force: bool = False
) -> ReplayReport:
    """Put dead letters back on the lane they came from, as new entries.

    A request that was answered (say with a ``poisoned`` error) keeps that result unless
    ``force`` deletes it first, so the replay can store a new one.
    """
    keys = ModelKeys(model)
    report = ReplayReport()
    for dead in _select(client, model, ids):
        rid = dead.request_id
        if rid is not None and client.exists(keys.result(rid)):
            if not force:
                report.skipped.append(dead.id)
                continue
            client.delete(keys.result(rid))
        pipe = client.pipeline(transaction=True)
        pipe.xadd(dead.source, dead.original)
        pipe.xdel(keys.dead, dead.id)
        pipe.execute()
        report.replayed.append(dead.id)
    return report


def purge(client: redis.Redis, model: str, ids: Sequence[str] | None = None) -> int:
    """Delete dead letters (all when ``ids`` is None); returns how many."""
    key = ModelKeys(model).dead
    if ids is None:
        count = int(client.xlen(key))
        client.delete(key)
        return count
    return int(client.xdel(key, *ids)) if ids else 0
