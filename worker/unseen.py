"""Deliveries a worker never saw: entries Redis handed its consumer in a reply that was lost
(the connection dropped while the answer was on its way, or Redis crashed after delivering,
its PEL persisted). They are pending on the live worker, so no takeover moves them, and only
the idle fallback (``claim_idle_ms``) would. The intake remembers what it posted to its loop;
after a Redis call failed unreachable, or a connection was dropped (redis-py may have
sent a call again by itself, hiding a lost reply: ``batchfleet/drops.py``), its
consumer's pending entries never posted are taken again (docs/reliability.md, "A lost read").
So are those the sink acked whose ack a Redis Cluster failover lost (the sink settles them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..drops import DropCount
from .streams import Entry, ModelStreams, Pending

PRUNE_AT = 4096
"""Posted keys remembered past this many (or twice those pending at the last look) are
checked against the consumer's pending entries: one ``XPENDING`` per lane, every few
thousand deliveries."""


class Unseen:
    """The keys posted to the loop, and whether to look for deliveries never posted."""

    def __init__(self, drops: DropCount | None = None) -> None:
        self._posted: set[str] = set()
        self._lock = threading.Lock()
        """The sink's thread settles entries while the intake's posts and looks."""
        self._prune_at = PRUNE_AT
        self.suspected = False
        """A Redis call failed unreachable since the last look: a reply may have been lost."""
        self._drops = drops
        """Connections dropped (None: not counted), each may have lost a reply."""
        self._dropped = drops.value if drops else 0
        """Their count at the last look."""

    def posted(self, entries: Iterable[Entry]) -> None:
        """These entries reached the loop (which, or its sink, answers or releases them)."""
        with self._lock:
            self._posted.update(e.key for e in entries)

    def dropped(self, entries: Iterable[Entry]) -> None:
        """These entries are no longer this consumer's (another worker took them over)."""
        with self._lock:
            self._posted.difference_update(e.key for e in entries)

    settled = dropped
    """These entries were acked by the sink (its thread): no longer held. Pending again
    after a Redis Cluster failover lost the ack with the master (asynchronous
    replication), they are taken again, not left to the idle fallback."""

    def due(self) -> bool:
        """Whether to look: a reply may have been lost since the last look, or the posted
        keys grew past their bound."""
        dropped = self._drops is not None and self._drops.value != self._dropped
        return self.suspected or dropped or len(self._posted) > self._prune_at

    def find(self, streams: ModelStreams, known: Iterable[str]) -> list[Pending]:
        """The entries pending on this consumer that were never posted, nor are ``known``
        (already to be taken again); forgets the posted keys no longer pending."""
        self.suspected = False
        if self._drops is not None:  # (read first: a drop during the look looks again)
            self._dropped = self._drops.value
        pending = streams.own_pending(limit=len(self._posted) + 10_000)
        with self._lock:
            self._posted.intersection_update(p.key for p in pending)
            self._prune_at = max(PRUNE_AT, 2 * len(self._posted))
            skip = self._posted.union(known)
        return [p for p in pending if p.key not in skip]


def take_next(
    pending: list[Pending], budget: int, suspects: bool
) -> tuple[list[Pending], list[Pending]]:
    """(what is left, what to take now) of pending entries to take again: first deliveries
    in bulk, a suspect (delivered before) alone, and only when ``suspects``."""
    first = [p for p in pending if p.deliveries <= 1][:budget]
    again = [p for p in pending if p.deliveries > 1][: 1 if suspects and not first else 0]
    chosen = first or again
    return [p for p in pending if p not in chosen], chosen
