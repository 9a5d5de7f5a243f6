"""The worker's typed view of one model's lane streams: read, finish, dead-letter, reclaim.

:class:`ModelStreams` is the one handle a worker holds on a model's keys: the lane streams
here, with the registry (``registry.py``), the token streams (``token_stream.py``) and the
model's published state (``model_publish.py``) it inherits; the Lua scripts are loaded
once, in ``redis_model.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..schemas.keys import GROUP
from .model_publish import ModelPublisher
from .registry import Registry
from .token_stream import TOKENS_MAXLEN, TokenStreams, TokenWrite

FINISH_CHUNK = 256
"""Results stored per script call: one round trip per batch, and a bounded script run."""
REFRESH_CHUNK = 512
"""Entries refreshed per script call (a bounded script run)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One lane-stream entry as read by this worker."""

    lane: int
    id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1
    blobs: Mapping[str, bytes | None] | None = None
    """The input keys its request references, as read by the intake (worker/blobs.py)."""

    @property
    def key(self) -> str:
        """Unique across the model's lanes (ids are unique only within one stream)."""
        return f"{self.lane}/{self.id}"

    @property
    def enqueued_ms(self) -> int:
        """Redis server time (unix ms) at which the entry was added: its id's first part."""
        return int(self.id.split("-", 1)[0])


class Pending(NamedTuple):
    """An entry pending on this consumer, as ``XPENDING`` tells it."""

    lane: int
    id: str
    deliveries: int
    idle_ms: int

    @property
    def key(self) -> str:
        """As :attr:`Entry.key`."""
        return f"{self.lane}/{self.id}"


@dataclass(frozen=True, slots=True)
class Retiring:
    """A redelivered entry whose request has a stored result already."""

    entry: Entry
    request_id: str
    reply: str | None


@dataclass(frozen=True, slots=True)
class Finish:
    """A result to store for one entry."""

    entry: Entry
    request_id: str
    payload: bytes
    ttl_s: int
    reply: str | None
    fenced: bool = False
    """A generation's attempt: stored only if not superseded (see ``finish.lua``)."""
    end: TokenWrite | None = None
    """The token stream's end, appended with the result (a streamed generation)."""


STORED, DUPLICATE, SUPERSEDED = 1, 0, 2
"""What :meth:`ModelStreams.finish` did with a result: stored it, found another one stored
(which stands), or stored nothing (a later attempt at the request owns it now)."""


class ModelStreams(Registry, TokenStreams, ModelPublisher):
    """Reads and retires one model's lane streams as one consumer of the group."""

    def depths(self) -> tuple[list[int], list[int]]:
        """Entries in each lane stream, and how many of them are pending (being worked on)."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)
        replies = pipe.execute()
        return replies[0::2], [int(p["pending"]) for p in replies[1::2]]

    def read(
        self, counts: Mapping[int, int], block_ms: int | None, *, idle: bool = False
    ) -> list[Entry]:
        """New entries for this consumer: up to ``counts[lane]`` from each lane (one round
        trip); if there are none and ``block_ms`` is set, block that long on all lanes.
        One lane asked with ``block_ms``: one blocking read, which returns at once with
        what there is (a saturated worker's lane-0 reserve, read again and again).
        ``idle``: the last read of these counts blocked and found nothing: this one goes on
        blocking at once, without a first look (what came meanwhile, the block returns as
        it would have had it gone on), one round trip a wait instead of two."""
        asked = [lane for lane, n in sorted(counts.items()) if n > 0]
        if idle and len(asked) > 1 and block_ms is not None:
            return self._block(asked, counts, block_ms)
        if len(asked) == 1 and block_ms is not None:
            (lane,) = asked
            one: Any = self.client.xreadgroup(GROUP, self.consumer, {self.streams[lane]: ">"},
                                              count=counts[lane], block=max(1, block_ms))  # fmt: skip
            return self._entries(one)
        pipe = self.client.pipeline(transaction=False)
        for lane in asked:
            pipe.xreadgroup(GROUP, self.consumer, {self.streams[lane]: ">"}, count=counts[lane])
        out = [e for reply in pipe.execute() for e in self._entries(reply)]
        if out or block_ms is None:
            return out
        return self._block(asked, counts, block_ms)

    def _block(self, asked: list[int], counts: Mapping[int, int], block_ms: int) -> list[Entry]:
        """One read blocking up to ``block_ms`` on all ``asked`` lanes."""
        reply: Any = self.client.xreadgroup(
            GROUP,
            self.consumer,
            {self.streams[lane]: ">" for lane in asked},
            count=max(counts.values()),
            block=max(1, block_ms),
        )
        return self._entries(reply)

    def _entries(self, reply: list[Any] | None) -> list[Entry]:
        out: list[Entry] = []
        for stream, messages in reply or []:
            lane = self._lane_of[stream if isinstance(stream, bytes) else stream.encode()]
            for entry_id, fields in messages:
                if fields:  # None: deleted while pending
                    out.append(Entry(lane, entry_id.decode(), fields))
        return out

    def read_inputs(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        """Input blobs clients wrote (``bf:{model}:input:<name>``), one round trip; at most
        ``max_bytes + 1`` bytes of each (so an oversized one is seen, not read whole);
        None for a key that is missing (or empty)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(key, 0, max_bytes)
        return [bytes(v) if v else None for v in pipe.execute()]

    def reclaim(
        self,
        min_idle_ms: int,
        count: int,
        *,
        suspects: bool,
        dead: Sequence[str] = (),
        dead_idle_ms: int = 0,
        lock_ms: int = 2000,
    ) -> list[Entry]:
        """Take over entries whose worker died.

        Entries of the ``dead`` consumers (their heartbeat stopped) are taken once idle for
        ``dead_idle_ms``; any consumer's entries once idle for ``min_idle_ms`` (the fallback
        for entries handed back at shutdown, or left by a loop that no longer holds them: a
        live worker refreshes those it holds, see :meth:`refresh`).
        Entries on their first redelivery are taken up to ``count``. Entries that were
        already redelivered (their last two holders died: one of them may be the cause)
        are taken one at a time, and only when ``suspects`` is true, so a suspect runs
        alone and an innocent entry never dies alongside a poison one. One worker reclaims
        at a time per model (a short Redis lock), so live workers do not steal back and
        forth. Each entry carries its delivery count, for the caller's poison check.
        """
        lock = self.keys.reclaim_lock
        mine = self.client.set(lock, self.consumer, nx=True, px=lock_ms)
        if not mine and self.client.get(lock) != self.consumer.encode():
            return []
        out: list[Entry] = []
        for lane, stream in enumerate(self.streams):
            pending = self.client.xpending_range(
                stream, GROUP, min="-", max="+", count=count, idle=min_idle_ms
            )
            for name in dead:
                if name != self.consumer:
                    pending += self.client.xpending_range(
                        stream, GROUP, min="-", max="+", count=count, idle=dead_idle_ms,
                        consumername=name,
                    )  # fmt: skip
            seen: dict[Any, dict[str, Any]] = {p["message_id"]: p for p in pending}
            unique = list(seen.values())
            first = [p for p in unique if p["times_delivered"] <= 1][:count]
            again = [p for p in unique if p["times_delivered"] > 1][: 1 if suspects else 0]
            if suspects and again:
                suspects = False
            chosen = {p["message_id"]: int(p["times_delivered"]) for p in first + again}
            if not chosen:
                continue
            # Claim with the idle bound each passed (a dead consumer's may be younger than
            # min_idle_ms): an entry another worker claimed meanwhile is idle 0 and stays.
            bound = min(min_idle_ms, dead_idle_ms) if dead else min_idle_ms
            claimed: Any = self.client.xclaim(stream, GROUP, self.consumer, bound, list(chosen))
            for entry_id, fields in claimed:
                if fields:  # None: deleted while pending
                    out.append(Entry(lane, entry_id.decode(), fields, chosen[entry_id] + 1))
                else:
                    self.client.xack(stream, GROUP, entry_id)
        return out

    def release(self, entries: Sequence[Entry], idle_ms: int, *, counted: bool = False) -> None:
        """Hand entries this worker read but will not compute back to the fleet: mark them
        idle long enough for the next reclaim. The next claim counts a delivery; unless
        ``counted`` (they failed here), the count is first set back so it does not."""
        by_key: dict[tuple[int, int], list[Any]] = {}
        for e in entries:
            retries = e.deliveries if counted else max(0, e.deliveries - 1)
            by_key.setdefault((e.lane, retries), []).append(e.id)
        for (lane, retries), ids in by_key.items():
            self.client.xclaim(
                self.streams[lane], GROUP, self.consumer, 0, ids, idle=idle_ms,
                retrycount=retries, justid=True,
            )  # fmt: skip

    def refresh(self, entries: Sequence[Entry]) -> tuple[int, list[Entry]]:
        """Reset the idle time of these entries where still pending on this consumer, so the
        idle fallback leaves a live worker's long requests alone; no delivery is counted.
        Returns how many were refreshed, and those now pending on another consumer (taken
        over: no longer this worker's to answer)."""
        done = 0
        lost: list[Entry] = []
        for start in range(0, len(entries), REFRESH_CHUNK):
            chunk = entries[start : start + REFRESH_CHUNK]
            args: list[str | int] = [GROUP, self.consumer]
            for e in chunk:
                args += [e.lane, e.id]
            reply = self._refresh(keys=self.streams, args=args)
            done += int(reply[0])
            lost += [chunk[int(k)] for k in reply[1:]]
        return done, lost

    def own_pending(self, limit: int = 10_000) -> list[Pending]:
        """This consumer's pending entries."""
        out: list[Pending] = []
        for lane, stream in enumerate(self.streams):
            for p in self.client.xpending_range(
                stream, GROUP, "-", "+", limit, consumername=self.consumer
            ):
                mid = p["message_id"]
                eid = mid.decode() if isinstance(mid, bytes) else str(mid)
                delivered, idle = int(p["times_delivered"]), int(p["time_since_delivered"])
                out.append(Pending(lane, eid, delivered, idle))
        return out

    def claim_own(self, items: Sequence[Pending], *, counted: bool = True) -> list[Entry]:
        """Deliver again entries pending on this consumer. ``counted``: a delivery is counted
        (a previous life's entries: that process may have died of them); else each keeps
        its count (a delivery whose reply was lost: this worker never saw it), and one
        another worker took meanwhile (idle since) stays there."""
        out: list[Entry] = []
        groups: dict[tuple[int, int], list[Any]] = {}
        for p in items:
            count = p.deliveries + 1 if counted else max(1, p.deliveries)
            groups.setdefault((p.lane, count), []).append(p.id)
        idle = 0 if counted else min((p.idle_ms for p in items), default=0)
        for (lane, count), chosen in groups.items():
            stream = self.streams[lane]
            # RETRYCOUNT sets the count (Redis adds none then): a claim that redis-py sends
            # again after a lost reply counts no second delivery
            claimed: Any = self.client.xclaim(
                stream, GROUP, self.consumer, idle, chosen, retrycount=count
            )
            for entry_id, fields in claimed:
                eid = entry_id.decode()
                if fields:
                    out.append(Entry(lane, eid, fields, count))
                else:  # deleted while pending
                    self.client.xack(stream, GROUP, entry_id)
        return out

    def have_results(self, request_ids: Sequence[str]) -> list[bool]:
        """Which of these requests have a stored result (redeliveries)."""
        if not request_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(self.keys.result(rid))
        return [bool(n) for n in pipe.execute()]

    def retire(self, items: Sequence[Retiring]) -> list[bool]:
        """Ack redelivered entries whose result is stored, publishing it on their reply
        channel (one script call); True where retired."""
        if not items:
            return []
        keys = [self.keys.result(it.request_id) for it in items] + self.streams
        args: list[str | bytes | int] = [GROUP, len(items)]
        for it in items:
            args += [it.entry.id, it.entry.lane, it.reply or ""]
        return [bool(x) for x in self._retire(keys=keys, args=args)]

    def mark_started(self, items: Sequence[tuple[str, int]]) -> None:
        """Say that this worker admitted these requests, (id, TTL in seconds) each: their
        ``started`` keys hold its consumer name (docs/protocol.md, "Started")."""
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        for request_id, ttl_s in items:
            pipe.set(self.keys.started(request_id), self.consumer, ex=ttl_s)
        pipe.execute()

    def requeued(self, request_ids: Sequence[str]) -> None:
        """Say that these requests wait again (taken over from a worker that died, or one
        that stopped refreshing them): their ``started`` keys go, until a worker admits
        them again (docs/protocol.md, "Started")."""
        if request_ids:
            self.client.delete(*(self.keys.started(r) for r in request_ids))

    def cancelled(self, request_ids: Sequence[str]) -> list[str]:
        """Which of these requests a client asked to cancel."""
        if not request_ids:
            return []
        found = self.client.mget([self.keys.cancel(r) for r in request_ids])
        return [r for r, v in zip(request_ids, found, strict=True) if v is not None]

    def finish(self, items: Sequence[Finish]) -> list[int]:
        """Store, publish and ack many results in one round trip (one script call per
        ``FINISH_CHUNK`` results); for each, ``STORED``, ``DUPLICATE`` or ``SUPERSEDED``."""
        out: list[int] = []
        for start in range(0, len(items), FINISH_CHUNK):
            chunk = items[start : start + FINISH_CHUNK]
            keys = [self.keys.result(it.request_id) for it in chunk] + self.streams
            keys += [self.keys.tokens(it.request_id) for it in chunk]
            args: list[str | bytes | int] = [GROUP, len(chunk), self.consumer, TOKENS_MAXLEN]
            for it in chunk:
                end = it.end
                args += [it.entry.id, it.entry.lane, it.payload, it.ttl_s, it.reply or "",
                         int(it.fenced), "" if end is None else end.seq,
                         0 if end is None else abs(end.life)]  # fmt: skip
            # Called directly, not on a pipeline: a pipeline holding a script first asks
            # SCRIPT EXISTS, a second round trip each time.
            out += [int(x) for x in self._finish(keys=keys, args=args)]
        return out

    def dead_letter(self, entry: Entry, code: str, reason: str, worker: str, maxlen: int) -> str:
        flat: list[bytes | str] = []
        for k, v in entry.fields.items():
            flat += [k, v]
        args = [GROUP, entry.id, code, reason[:1000], maxlen, worker, *flat]
        dead_id = self._dead(keys=[self.keys.dead, self.streams[entry.lane]], args=args)
        return dead_id.decode() if isinstance(dead_id, bytes) else str(dead_id)
