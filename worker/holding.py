"""What a loop holds, as its intake sees it: the entries to keep fresh, and since when the
device step in flight runs (a step running past ``claim_idle_ms`` means a hung device).

The loop hands a :class:`Holding` over through :class:`HoldingFeed` (cheaply: only when it
changed, at most every ``HAND_OVER_EVERY_S``); the intake asks :func:`entries_to_refresh`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .answers import Held
from .streams import Entry

HAND_OVER_EVERY_S = 0.1
"""The loop hands the intake what it holds at most this often (a quarter of
``claim_idle_ms`` if shorter): a pass stays cheap, and the intake's view lags this much."""


@dataclass(frozen=True, slots=True)
class Holding:
    """The entries a loop holds (waiting, queued, on the device, generating), and when the
    device step in flight began (None: the device is idle)."""

    entries: tuple[Entry, ...] = ()
    busy_since: float | None = None


def hung_for(holding: Holding, now: float, claim_idle_ms: int) -> float | None:
    """How long the device step in flight has run, once longer than ``claim_idle_ms`` (a
    hung device); None while it has not, or the device is idle."""
    if holding.busy_since is None:
        return None
    ran = now - holding.busy_since
    return ran if ran * 1000 > claim_idle_ms else None


def entries_to_refresh(holding: Holding, now: float, claim_idle_ms: int) -> tuple[Entry, ...]:
    """The entries whose idle time to reset now: all held, unless the device is hung
    (:func:`hung_for`): then none, and the idle fallback hands them to other workers."""
    if hung_for(holding, now, claim_idle_ms) is not None:
        return ()
    return holding.entries


class Holder(Protocol):
    """What the feed reads of a scheduler."""

    held: dict[str, Held]

    @property
    def busy(self) -> bool: ...
    @property
    def version(self) -> int: ...
    @property
    def busy_since(self) -> float | None: ...
    def holding(self) -> tuple[Entry, ...]: ...


class HoldingFeed:
    """The loop's side: hands ``hold`` a new :class:`Holding` when the scheduler's entries
    (its ``version``) or ``busy_since`` changed, at most every ``every`` seconds, except at
    once when it starts or stops holding anything."""

    def __init__(self, hold: Callable[[Holding], None], every: float) -> None:
        self._hold = hold
        self._every = every
        self._version = -1
        self._since: float | None = None
        self._entries: tuple[Entry, ...] = ()
        self._empty = True
        self._next = -1e18

    def update(self, holder: Holder, now: float) -> float | None:
        """Hand over if due; returns when to come back for a deferred handover (None:
        nothing is deferred)."""
        version, since = holder.version, holder.busy_since
        if version == self._version and since == self._since:
            return None
        empty = not holder.held and not holder.busy
        if now < self._next and not (empty or self._empty):
            return self._next
        if version != self._version:
            self._entries = holder.holding()
        self._version, self._since, self._empty = version, since, empty
        self._next = now + self._every
        self._hold(Holding(self._entries, since))
        return None
