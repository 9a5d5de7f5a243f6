"""Taking over what dead workers hold, for one model's intake: when to judge heartbeats (not
until connected for a whole ``heartbeat_timeout_ms``: after an outage every heartbeat looks
old), taking the dead consumers' entries and the idle fallback's (``claim_idle_ms``), and,
now and then, forgetting workers dead past ``dead_worker_retention_s``.
"""

from __future__ import annotations

import logging

import redis

from ..config import WorkerConfig
from .streams import Entry, ModelStreams

logger = logging.getLogger(__name__)

RECLAIM_EVERY_S = 1.0
PRUNE_EVERY_S = 30.0
"""How often a worker removes what workers whose heartbeat is gone left: hostname and serving
entries, and past ``dead_worker_retention_s`` heartbeats and consumers
(``ModelStreams.prune``): they only grow with restarts under new names."""


class Takeover:
    """One model's takeover of dead workers' entries (the intake's thread calls it)."""

    def __init__(self, streams: ModelStreams, worker: WorkerConfig) -> None:
        self.streams = streams
        self.worker = worker
        self.connected_since = 0.0
        """Since when Redis answers (heartbeats are judged a whole timeout after)."""
        self.judged = False
        """Heartbeats were judged since the connection was last (re)made."""
        self.last = -1e18
        """When the last pass ran."""
        self._last_prune = -1e18
        self._found = False
        """The last pass found entries: a suspect may follow at once."""

    def disconnected(self, until: float) -> None:
        """Redis was unreachable: heartbeats written meanwhile were lost too, so judge none
        until connected for a whole timeout again from ``until`` (or a Redis restart looks
        like every worker died)."""
        self.connected_since = until
        self.judged = False

    def due(self, now: float, suspects: bool) -> bool:
        """A pass is due: once a second, at once after one that found entries (when a
        suspect may be taken), and as soon as heartbeats can be judged again."""
        timeout_ms = self.worker.heartbeat_timeout_ms
        judge_now = not self.judged and (now - self.connected_since) * 1000 >= timeout_ms
        return now - self.last >= RECLAIM_EVERY_S or (self._found and suspects) or judge_now

    def take(self, now: float, count: int, suspects: bool) -> list[Entry]:
        """Entries of dead workers (and the idle fallback's), up to ``count`` first
        deliveries or one suspect (``ModelStreams.reclaim``)."""
        self.last = now
        timeout = self.worker.heartbeat_timeout_ms
        dead: list[str] = []
        if (now - self.connected_since) * 1000 >= timeout:
            self.judged = True
            live = self.streams.live_consumers(int(now * 1000), timeout)
            dead = [c for c in self.streams.holders() if c not in live]
            if now - self._last_prune >= PRUNE_EVERY_S:
                self._last_prune = now
                self._prune(int(now * 1000))
        found = self.streams.reclaim(
            self.worker.claim_idle_ms, count, suspects=suspects, dead=dead, dead_idle_ms=timeout
        )
        self._found = bool(found)
        if found:
            logger.info("took over %d entries (dead workers: %s)", len(found), dead)
        return found

    def _prune(self, now_ms: int) -> None:
        """Forget dead workers (housekeeping: a refusal, such as an ACL without ``XINFO``,
        is logged and never stops the takeover that follows)."""
        retention_ms = self.worker.dead_worker_retention_s * 1000
        try:
            pruned = self.streams.prune(now_ms, self.worker.heartbeat_timeout_ms, retention_ms)
        except redis.ResponseError as exc:
            logger.warning(
                "model %s: pruning dead workers failed: %s", self.streams.keys.model, exc
            )
            return
        if pruned.heartbeats or pruned.consumers:
            logger.info(
                "model %s: forgot workers dead for over %d s (%d heartbeats, %d consumers)",
                self.streams.keys.model, self.worker.dead_worker_retention_s,
                pruned.heartbeats, pruned.consumers,
            )  # fmt: skip
