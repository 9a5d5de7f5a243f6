"""The intake: one model's reading side, on a thread of its own.

It heartbeats, keeps the entries the loop holds from looking abandoned (:meth:`Intake.hold`;
not once a device step has hung past ``claim_idle_ms``), takes over the entries of workers
that died (``takeover.py``; at start, its own from a previous life under the same name;
after an outage, or a dropped connection redis-py hid by retrying, those Redis delivered
in a reply it lost: ``unseen.py``), and reads as many new entries as the loop last asked
for (:meth:`Intake.grant`), posting them to the loop's inbox. Being its own thread, its
heartbeat and refreshes never wait for a batch (a long batch or generation is taken neither
for a dead worker's nor by another worker's idle fallback), and the loop never sits in a
Redis ``BLOCK`` that the end of a batch could not interrupt.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from ..config import WorkerConfig
from ..drops import DROPS
from ..redis_errors import UNREACHABLE, refused_for_now
from ..schemas.messages import Limits
from ..schemas.model_info import ModelInfo, WorkerServing
from .arrivals import answered, cancelled_before, with_blobs
from .holding import Holding, entries_to_refresh, hung_for
from .inbox import IDLE_REPORTS, Arrived, Event, Lost, ReadIdle, Retire
from .streams import Entry, ModelStreams, Pending, Retiring
from .takeover import Takeover
from .unseen import Unseen, take_next

logger = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 1.0
SUSPECT_GRACE_S = 10.0
"""After a heartbeat silence, token writes stay checked this long (:meth:`Intake.suspect`)."""
LANE0_ONLY_BLOCK_MS = 50
"""The longest blocking read under a grant of lane 0 alone (a generating worker's lane-0
reserve while lower lanes fill its hold)."""
REFRESH_MAX_S = 60.0
"""The held entries' idle time is reset every ``claim_idle_ms / 4``, at most this long."""
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0
"""A read or heartbeat that cannot reach Redis is tried again this long after, doubling."""
ERROR_PAUSE_S = 1.0
"""The pause after any other failure of the intake's pass."""


class Intake:
    """Reads one model's lane streams for its loop."""

    def __init__(
        self,
        streams: ModelStreams,
        worker: WorkerConfig,
        limits: Limits,
        clock: Callable[[], float],
        post: Callable[[Event], None],
        *,
        sync_clock: Callable[[], None] | None = None,
        check_cancels: bool = False,
        info: ModelInfo | None = None,
        tokenizer: Mapping[str, Any] | None = None,
        name: str = "intake",
    ) -> None:
        self.streams = streams
        self.worker = worker
        self.limits = limits
        self.info = info
        """The model's info, published with the limits (``ModelStreams.publish_info``)."""
        self.tokenizer = tokenizer
        """Its tokenizer's configuration, published with them (``/tokenizer_info``)."""
        self._clock = clock
        self._post = post
        self._sync_clock = sync_clock
        self._check_cancels = check_cancels
        """A generating model: requests cancelled before they were read are told at once."""
        self._cond = threading.Condition()
        self._counts: dict[int, int] = {}
        self._suspects = True
        self._stop = False
        self._last_beat = -1e18
        self._holding = Holding()
        """The loop's latest snapshot of what it holds (its entries refreshed while held)."""
        self._withheld = False
        """The last refresh was withheld: the device step in flight looks hung."""
        self._beat_ok = -1e18
        """When a heartbeat last reached Redis."""
        self._silence_s = 0.8 * worker.heartbeat_timeout_ms / 1000
        """A heartbeat silence this long may have made others take this worker for dead."""
        self._suspect_until = -1e18
        self._last_refresh = -1e18
        self._refresh_every = min(worker.claim_idle_ms / 4000, REFRESH_MAX_S)
        self._refreshing = threading.Lock()
        """Held across a refresh and a release: a released entry is never refreshed after."""
        self._posted = 0
        self._idle_reads = 0
        """Empty reads in a row since the last delivery (see :data:`IDLE_REPORTS`)."""
        self._idle_grant: dict[int, int] | None = None
        """The grant whose last read blocked and found nothing, while nothing else was done
        since: the next read of it blocks at once (``ModelStreams.read``'s ``idle``)."""
        self._takeover = Takeover(streams, worker)
        self._max_depth: int | None = None
        self._own: list[Pending] = []
        """Entries pending on this consumer name when it started: a previous life's."""
        self._unseen: list[Pending] = []
        """Entries Redis delivered to this consumer whose reply was lost (a dropped
        connection, a Redis crash): pending here, yet never posted to the loop."""
        self._lost_reads = Unseen(DROPS)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- the loop's side ----------------------------------------------------------------

    def start(self, max_depth: int | None) -> None:
        """Create the groups, register, and start reading (as granted)."""
        if self._sync_clock is not None:
            self._sync_clock()
        self._max_depth = max_depth
        self.streams.ensure_groups(max_depth, self.limits, self.info, self.tokenizer,
                                   self.worker.heartbeat_timeout_ms)  # fmt: skip
        # A fresh loop holds nothing: whatever is pending under this name was left by an
        # earlier process of the same name (a container restarted in place).
        self._own = self.streams.own_pending()
        if self._own:
            logger.info(
                "%d entries pending from a previous life: taking them again", len(self._own)
            )
        self._takeover.connected_since = self._beat_ok = self._clock()  # (fresh: no silence)
        info = self.info
        self.streams.identify(serving=WorkerServing(
            version=info.version if info else None, config_hash=info.config_hash if info else None,
            heartbeat_timeout_ms=self.worker.heartbeat_timeout_ms))  # fmt: skip
        self._beat(force=True)
        self._thread.start()

    def grant(self, counts: Mapping[int, int], suspects: bool, seen: int) -> None:
        """Read up to ``counts[lane]`` new entries (replacing the last grant); take over a
        suspect (a twice-redelivered entry) only when ``suspects``. ``seen``: how many
        deliveries the loop has taken in; a grant made before it saw the latest one is
        stale (it does not count what that one brought) and is ignored."""
        counts = {lane: n for lane, n in counts.items() if n > 0}
        with self._cond:
            if seen < self._posted:
                return
            if counts == self._counts and suspects == self._suspects:
                return
            self._counts = counts
            self._suspects = suspects
            self._cond.notify()

    def hold(self, holding: Holding) -> None:
        """What the loop holds now, replacing the last snapshot: its entries' idle time is
        reset every ``claim_idle_ms / 4`` while held, unless its device step hangs."""
        was = self._holding  # written by the loop thread only (here and in release)
        self._holding = holding  # one reference swapped: the thread reads whole snapshots
        if self._withheld and holding.busy_since != was.busy_since:
            # the hung step ended: what the idle fallback gave away meanwhile is found out
            # at once, and the token writes stay checked until the loop dropped it
            self._suspect_until = self._clock() + SUSPECT_GRACE_S
            self._last_refresh = -1e18
            with self._cond:
                self._cond.notify()
        elif holding.entries and not was.entries:  # the thread may sleep until its next beat
            with self._cond:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def release(self, entries: Sequence[Entry]) -> None:
        """Hand entries read but never started back to the fleet (after :meth:`join`)."""
        if entries:
            gone = {e.key for e in entries}
            with self._refreshing:
                h = self._holding
                kept = tuple(e for e in h.entries if e.key not in gone)
                self._holding = Holding(kept, h.busy_since)
                self.streams.release(entries, self.worker.claim_idle_ms)
            logger.info("released %d unstarted requests to the fleet", len(entries))

    def settled(self, entries: Sequence[Entry]) -> None:
        """The sink acked these entries (any thread): pending here again after a failover
        lost the ack, they are taken again as deliveries the loop no longer holds."""
        self._lost_reads.settled(entries)

    def unregister(self) -> None:
        self.streams.unregister()

    # --- the thread ---------------------------------------------------------------------

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less where stopped: a stop that came while a Redis call
        failed (its notify gone before this wait) is not waited out."""
        with self._cond:
            if not self._stop:
                self._cond.wait(seconds)

    def _run(self) -> None:
        backoff = RETRY_FIRST_S
        while True:
            with self._cond:
                if self._stop:
                    return
                if not self._counts:
                    self._cond.wait(self._until_due())
                    if self._stop:
                        return
                counts, suspects = dict(self._counts), self._suspects
            try:
                self._beat()
                self._refresh()
                if counts:
                    self._read(counts, suspects)
                backoff = RETRY_FIRST_S
            except UNREACHABLE as exc:
                backoff = self._wait_out(exc, backoff, "redis unreachable")
            except redis.ResponseError as exc:
                if refused_for_now(exc):  # NOREPLICAS, LOADING...: a failover, not a bug
                    backoff = self._wait_out(exc, backoff, "redis refused the call for now")
                    continue
                if not str(exc).startswith("NOGROUP"):
                    logger.exception("intake of %s failed; retrying", self.streams.keys.model)
                else:  # the server lost its data (a restart without persistence): start over
                    logger.warning("consumer group gone (%s): creating it again", exc)
                    with contextlib.suppress(redis.RedisError):
                        self.streams.ensure_groups(
                            self._max_depth, self.limits, self.info, self.tokenizer,
                            self.worker.heartbeat_timeout_ms,
                        )  # fmt: skip
                        continue
                self._pause(ERROR_PAUSE_S)
            except Exception:
                logger.exception("intake of %s failed; retrying", self.streams.keys.model)
                self._pause(ERROR_PAUSE_S)

    def _wait_out(self, exc: Exception, backoff: float, what: str) -> float:
        """Redis cannot serve the intake for now: say so in one line, wait ``backoff``, and
        return the next one (doubled). Heartbeats and replies may have been lost meanwhile,
        as in an outage: others' heartbeats are not judged at once, and this consumer's
        pending entries are checked for a lost reply."""
        self._takeover.disconnected(self._clock() + backoff)
        self._lost_reads.suspected = True
        logger.warning("%s (%s); retrying in %.2fs", what, exc, backoff)
        self._pause(backoff)
        return min(backoff * 2, RETRY_MAX_S)

    def _beat(self, force: bool = False) -> None:
        now = self._clock()
        if force or now >= self._last_beat + HEARTBEAT_EVERY_S:
            self._last_beat = now
            if self._sync_clock is not None:
                self._sync_clock()
            self.streams.heartbeat(int(self._clock() * 1000))
            if now - self._beat_ok > self._silence_s:
                # silent long enough to be judged dead (the process stalled, or Redis was
                # unreachable): other workers may hold our entries now; find out at once
                self._last_refresh = -1e18
                self._suspect_until = now + SUSPECT_GRACE_S
            self._beat_ok = now

    def suspect(self) -> bool:
        """Whether other workers may have taken requests of this one lately: no heartbeat
        has reached Redis for most of ``heartbeat_timeout_ms`` now, its device step hangs
        (refreshes withheld), or either happened in the last ``SUSPECT_GRACE_S`` (until the
        loop has dropped what it lost). Its token writes are then checked (``tokens.lua``).
        Any thread."""
        now = self._clock()
        return now - self._beat_ok > self._silence_s or self._withheld or now < self._suspect_until

    def _until_due(self) -> float:
        """Seconds until the next heartbeat or refresh is due."""
        return max(
            0.0, min(self._last_beat + HEARTBEAT_EVERY_S, self._refresh_due()) - self._clock()
        )

    def _refresh_due(self) -> float:
        return self._last_refresh + self._refresh_every if self._holding.entries else float("inf")

    def _refresh(self) -> None:
        """Reset the idle time of the entries the loop holds, if due, so the idle fallback
        never takes a request from this live worker (its delivery count stays)."""
        now = self._clock()
        if now < self._refresh_due():
            return
        self._last_refresh = now
        with self._refreshing:
            holding = self._holding
            entries = entries_to_refresh(holding, now, self.worker.claim_idle_ms)
            lost: list[Entry] = []
            if entries:
                _, lost = self.streams.refresh(entries)
        if lost:
            logger.warning(
                "%d requests of %s were taken over by other workers (this one was "
                "unreachable or stalled past claim_idle_ms): dropping them",
                len(lost), self.streams.keys.model,
            )  # fmt: skip
            self._lost_reads.dropped(lost)
            self._post(Lost(tuple(lost)))
        withheld = bool(holding.entries) and not entries
        if withheld and not self._withheld and holding.busy_since is not None:
            logger.warning(
                "device step of %s running for %.1f s (> claim_idle_ms): no longer refreshing "
                "its %d held requests; the idle fallback hands them to other workers",
                self.streams.keys.model, now - holding.busy_since, len(holding.entries),
            )  # fmt: skip
        self._withheld = withheld

    def hung_for(self) -> float | None:
        """Seconds the device step in flight has run, once past ``claim_idle_ms`` (a hung
        device, whose entries are no longer refreshed); else None. Any thread may ask."""
        return hung_for(self._holding, self._clock(), self.worker.claim_idle_ms)

    def _read(self, counts: dict[int, int], suspects: bool) -> None:
        budget = sum(counts.values())
        idle, self._idle_grant = counts == self._idle_grant, None
        if self._lost_reads.due():
            self._find_unseen()
        if self._own:
            self._own, chosen = take_next(self._own, budget, suspects)
            self._deliver(self.streams.claim_own(chosen))
            return
        if self._unseen:
            self._unseen, chosen = take_next(self._unseen, budget, suspects)
            self._deliver(self.streams.claim_own(chosen, counted=False))
            return
        now = self._clock()
        if self._takeover.due(now, suspects):
            found = self._takeover.take(now, budget, suspects)
            if found:
                self._deliver(found)
                return
            idle = False  # (time went by: the lanes are looked at first again)
        # Never block past the next heartbeat (a silent worker is taken for dead) or refresh.
        block_ms = min(self.worker.block_ms, int(HEARTBEAT_EVERY_S * 1000))
        if set(counts) == {0} and self.streams.lanes > 1:
            # only lane 0's reserve is granted (the hold is full): block briefly, so a grant
            # for the other lanes made meanwhile does not wait out a long read of lane 0
            block_ms = min(block_ms, LANE0_ONLY_BLOCK_MS)
        if self._holding.entries:
            block_ms = min(block_ms, max(1, int((self._refresh_due() - self._clock()) * 1000)))
        entries = self.streams.read(counts, block_ms, idle=idle)
        if entries:
            self._deliver(entries)
            return
        self._idle_grant = counts
        self._idle_reads += 1
        if self._idle_reads <= IDLE_REPORTS or not self._holding.entries:
            self._post(ReadIdle())

    def _find_unseen(self) -> None:
        """Note the entries pending on this consumer that were never posted to the loop (nor
        are a previous life's): a read whose reply was lost. They are taken again with their
        delivery count kept, as the loop never saw them; those the loop (or the sink) holds
        were posted and stay theirs. Also forgets the posted keys no longer pending."""
        known = [p.key for p in (*self._own, *self._unseen)]
        unseen = self._lost_reads.find(self.streams, known)
        if unseen:
            logger.warning(
                "%d entries of %s were delivered to this worker in a reply it lost: taking "
                "them again", len(unseen), self.streams.keys.model,
            )  # fmt: skip
            self._unseen += unseen

    def _deliver(self, entries: list[Entry]) -> None:
        """Hand entries to the loop. Redelivered ones whose request has a result already go
        as :class:`Retire` (the sink republishes the stored result and acks them)."""
        if not entries:
            return
        retire: list[Retiring] = []
        cancelled: list[str] = []
        streams, limits = self.streams, self.limits
        try:
            entries = with_blobs(entries, streams, limits, self.worker.claim_idle_ms, self._pause)
            retire = answered(entries, streams, limits)
            if self._check_cancels:
                cancelled = cancelled_before(entries, streams, limits)
        finally:  # whatever happens, what was claimed reaches the loop
            self._lost_reads.posted(entries)
            retired = {f.entry.key for f in retire}
            fresh = [e for e in entries if e.key not in retired]
            self._idle_reads = 0
            with self._cond:
                self._counts = {}  # consumed: the loop grants again once it has admitted them
                self._posted += 1
            if retire:
                self._post(Retire(retire))
            # cancelled ones ride along: the loop ends them before any step starts them
            self._post(Arrived(fresh, self._clock(), tuple(cancelled)))
