"""What the intake refreshes (none while a device step hangs past ``claim_idle_ms``), and how
the loop hands it over: only when it changed, at most every interval, at once when it
starts or stops holding anything. Pure functions and a fake scheduler: no clock, no Redis."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchfleet.worker.answers import Held
from batchfleet.worker.holding import Holding, HoldingFeed, entries_to_refresh, hung_for
from batchfleet.worker.streams import Entry

A, B = Entry(0, "1-0", {}), Entry(1, "1-1", {})


def test_held_entries_are_refreshed_unless_the_device_step_runs_past_claim_idle_ms() -> None:
    assert entries_to_refresh(Holding((A, B), None), 100.0, 1000) == (A, B), "device idle"
    assert entries_to_refresh(Holding((A, B), 99.0), 100.0, 1000) == (A, B), "a 1 s step"
    assert entries_to_refresh(Holding((A, B), 98.9), 100.0, 1000) == (), "hung: 1.1 s"
    assert entries_to_refresh(Holding(), 100.0, 1000) == ()


def test_a_device_step_hangs_once_it_has_run_past_claim_idle_ms() -> None:
    assert hung_for(Holding((A,), None), 100.0, 1000) is None, "device idle"
    assert hung_for(Holding((A,), 99.0), 100.0, 1000) is None, "a 1 s step"
    assert hung_for(Holding((A,), 98.5), 100.0, 1000) == 1.5


@dataclass
class FakeScheduler:
    entries: tuple[Entry, ...] = ()
    version: int = 0
    busy_since: float | None = None
    held: dict[str, Held] = field(default_factory=dict)
    builds: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.entries)  # stands in for "holds something"

    def holding(self) -> tuple[Entry, ...]:
        self.builds += 1
        return self.entries

    def set(self, *entries: Entry) -> None:
        self.entries = entries
        self.version += 1


def test_the_feed_hands_over_changes_at_most_every_interval_and_says_when_to_come_back() -> None:
    got: list[Holding] = []
    feed, s = HoldingFeed(got.append, 0.1), FakeScheduler()
    # starting to hold: at once
    s.set(A)
    s.busy_since = 10.0
    assert feed.update(s, 10.0) is None and got == [Holding((A,), 10.0)]
    # unchanged: nothing built, nothing handed over
    assert feed.update(s, 10.01) is None and len(got) == 1 and s.builds == 1
    # a change right after the last handover: deferred until the interval is over
    s.set(A, B)
    assert feed.update(s, 10.02) == 10.1 and len(got) == 1
    assert feed.update(s, 10.6) is None and got[-1] == Holding((A, B), 10.0)
    # only the step's start changed: handed over without rebuilding the entries
    s.busy_since = 10.65
    assert feed.update(s, 10.7) is None and got[-1] == Holding((A, B), 10.65)
    assert s.builds == 2 and got[-1].entries is got[-2].entries
    # holding nothing any more: at once, however recent the last handover
    s.set()
    s.busy_since = None
    assert feed.update(s, 10.71) is None and got[-1] == Holding((), None)
