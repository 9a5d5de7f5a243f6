"""The fleet's registry of one model's workers: each worker's heartbeat, hostname and
serving entries, who is live, who holds pending entries, and forgetting the dead."""

from __future__ import annotations

from typing import NamedTuple

from ..schemas.keys import GROUP
from ..schemas.model_info import WorkerServing
from .redis_model import ModelRedis


class Pruned(NamedTuple):
    """What :meth:`Registry.prune` removed."""

    entries: int
    """Hostname and serving entries."""
    heartbeats: int
    consumers: int
    """Consumers deleted from the lanes' groups (one per lane a worker had read)."""


class Registry(ModelRedis):
    """This worker's entries in its model's registry, and what it reads of the others'."""

    _hostname: str | None = None
    _serving: str | None = None

    def identify(self, hostname: str | None = None, serving: WorkerServing | None = None) -> None:
        """What each heartbeat publishes after it: this worker's Celery ``hostname`` (where
        control broadcasts reach it: ``-d NAME`` finds it by either name) and what it
        ``serving`` the model with (the gateway's fingerprint, the control wait's window)."""
        if hostname is not None:
            self._hostname = hostname
        if serving is not None:
            self._serving = serving.model_dump_json(exclude_none=True)

    def heartbeat(self, now_ms: int) -> None:
        """Mark this consumer alive (readiness checks and `status` read this hash), with its
        hostname and serving entries (:meth:`identify`) in the same transaction: entries
        :meth:`prune` removed while it was silent come back with its next beat (the beat
        first: a prune between the two sees it fresh)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.workers, self.consumer, now_ms)
        if self._hostname is not None:
            pipe.hset(self.keys.hostnames, self.consumer, self._hostname)
        if self._serving is not None:
            pipe.hset(self.keys.serving, self.consumer, self._serving)
        pipe.execute()

    def unregister(self) -> None:
        """This worker stops: its heartbeat, hostname and serving entries go."""
        pipe = self.client.pipeline(transaction=False)
        for key in (self.keys.workers, self.keys.hostnames, self.keys.serving):
            pipe.hdel(key, self.consumer)
        pipe.execute()

    def prune(self, now_ms: int, timeout_ms: int, retention_ms: int) -> Pruned:
        """Forget workers that died or were renamed without stopping cleanly
        (``prune.lua``, atomic): their hostname and serving entries once their heartbeat is
        older than ``timeout_ms`` (or their own, where longer) or gone; their heartbeat, and
        their consumer in each lane's group where it holds no pending entry, once older
        than ``retention_ms``. Never this worker's own."""
        keys = [self.keys.workers, self.keys.serving, self.keys.hostnames, *self.streams]
        args: list[int | str] = [now_ms, timeout_ms, retention_ms, GROUP, self.consumer]
        return Pruned(*(int(n) for n in self._prune(keys=keys, args=args)))

    def live_consumers(self, now_ms: int, timeout_ms: int) -> set[str]:
        """Consumers whose last heartbeat is within ``timeout_ms`` of ``now_ms``."""
        beats = self.client.hgetall(self.keys.workers)
        return {
            (k.decode() if isinstance(k, bytes) else str(k))
            for k, v in beats.items()
            if now_ms - int(v) <= timeout_ms
        }

    def holders(self) -> dict[str, int]:
        """Consumers holding pending entries on any lane, with how many."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xpending(stream, GROUP)
        out: dict[str, int] = {}
        for summary in pipe.execute():
            for c in summary.get("consumers") or []:
                name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
                out[name] = out.get(name, 0) + int(c["pending"])
        return out
