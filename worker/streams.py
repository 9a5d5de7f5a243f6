"""The worker's typed view of one model's Redis keys: read, finish, dead-letter, reclaim."""

from __future__ import annotations

import importlib.resources
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import redis
from redis.commands.core import Script

from ..connection import SyncClient
from ..schemas.keys import GROUP, LORA_UNLOADED, MODELS_KEY, ModelKeys
from ..schemas.messages import Limits
from ..schemas.model_info import ModelInfo, WorkerServing, decode_model_info

FINISH_CHUNK = 256
"""Results stored per script call: one round trip per batch, and a bounded script run."""
REFRESH_CHUNK = 512
"""Entries refreshed per script call (a bounded script run)."""


def _script(client: SyncClient, name: str) -> Script:
    source = importlib.resources.files(__package__).joinpath("lua").joinpath(name).read_text()
    return client.register_script(source)


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


@dataclass(frozen=True, slots=True)
class Retiring:
    """A redelivered entry whose request has a stored result already."""

    entry: Entry
    request_id: str
    reply: str | None


TOKENS_MAXLEN = 100_000
"""A token stream's approximate MAXLEN (far above any request's tokens: a bound, not a cut)."""
TOKENS_CHUNK = 256
"""Token-stream entries per ``tokens.lua`` call."""
_TOKENS_MAXLEN_ARG = b"$%d\r\n%d\r\n" % (len(str(TOKENS_MAXLEN)), TOKENS_MAXLEN)


@dataclass(slots=True)  # not frozen: one per token and row (4x cheaper to build)
class TokenWrite:
    """One entry of a request's token stream: a delta (``text`` set), published on
    ``reply`` too, or (``text`` None) the stream's end."""

    request_id: str
    seq: int
    ttl_s: int
    """The stream's TTL, set with this entry (0: left as it is)."""
    text: str | None = None
    input: int = 0
    tokens: int = 0
    reply: str | None = None
    json: bool = False
    """The delta's message in JSON (else msgpack)."""
    model: str = ""
    logprobs: str | None = None
    """The delta's ``logprobs`` as JSON text (None: its request did not ask)."""
    life: int = 0
    """The writer's attempt at the request (its entry's delivery count; 0: none), negative
    where ``tokens.lua`` is to check it against the stream's last entry's."""
    tool_calls: str | None = None
    """The tool calls the delta completed, as JSON text (None: none)."""
    content: str | None = None
    """What the delta adds to its output's ``content`` (None: the output has none)."""
    reasoning: str | None = None
    """What it adds to its output's ``reasoning_content`` (None: the output has none)."""
    token_ids: str | None = None
    """Its tokens' ids as JSON text (None: its request did not ask)."""
    tool_call_chunks: str | None = None
    """The calls' pieces it wrote, as JSON text (None: none)."""
    prompt_tokens: int | None = None
    """Its output's prompt tokens (in its first delta; None: the others)."""
    prompt_text: str | None = None
    """Its input's prompt text (the first delta of its first output, where asked)."""
    prompt_logprobs: str | None = None
    """Its input's prompt log-probabilities as JSON text (where ``prompt_text`` would be)."""
    prompt_token_ids: str | None = None
    """Its prompt's token ids as JSON text (its output's first delta, where asked)."""

    def item(self) -> list[Any]:
        """The entry as ``tokens.lua`` takes it."""
        if self.text is None:
            return [self.seq, self.ttl_s, self.life]
        item = [self.seq, self.ttl_s, self.life, self.input, self.text, self.tokens,
                self.reply or "", int(self.json), self.request_id, self.model]  # fmt: skip
        prompt = None if self.prompt_tokens is None else str(self.prompt_tokens)
        more = [
            [name, value, raw]
            for name, value, raw in (
                ("logprobs", self.logprobs, 1),
                ("tool_calls", self.tool_calls, 1),
                ("token_ids", self.token_ids, 1),
                ("tool_call_chunks", self.tool_call_chunks, 1),
                ("content", self.content, 0),
                ("reasoning_content", self.reasoning, 0),
                ("prompt_tokens", prompt, 1),
                ("prompt_text", self.prompt_text, 0),
                ("prompt_logprobs", self.prompt_logprobs, 1),
                ("prompt_token_ids", self.prompt_token_ids, 1),
            )
            if value is not None
        ]
        if more:
            item.append(more)
        return item


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


class Pruned(NamedTuple):
    """What :meth:`ModelStreams.prune` removed."""

    entries: int
    """Hostname and serving entries."""
    heartbeats: int
    consumers: int
    """Consumers deleted from the lanes' groups (one per lane a worker had read)."""


class ModelStreams:
    """Reads and retires one model's lane streams as one consumer of the group."""

    def __init__(self, client: SyncClient, model: str, lanes: int, consumer: str) -> None:
        self.client = client
        self.keys = ModelKeys(model)
        self.lanes = lanes
        self.consumer = consumer
        self.streams = self.keys.lanes(lanes)
        self._lane_of = {name.encode(): i for i, name in enumerate(self.streams)}
        self._finish = _script(client, "finish.lua")
        self._dead = _script(client, "dead_letter.lua")
        self._retire = _script(client, "retire.lua")
        self._refresh = _script(client, "refresh.lua")
        self._tokens = _script(client, "tokens.lua")
        self._prune = _script(client, "prune.lua")
        self._hostname: str | None = None
        self._serving: str | None = None

    def ensure_groups(
        self, max_depth: int | None = None, limits: Limits | None = None,
        info: ModelInfo | None = None, tokenizer: Mapping[str, Any] | None = None,
        heartbeat_timeout_ms: int | None = None,
    ) -> None:  # fmt: skip
        """Create the group on every lane (from the stream's start, so nothing queued before
        the first worker is missed) and publish the lane count, depth limit and request
        limits for producers, and the model's info and ``tokenizer`` configuration for
        gateways (:meth:`publish_info`, :meth:`publish_tokenizer`), and the heartbeat
        timeout for control commands."""
        for stream in self.streams:
            try:
                self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self.client.set(self.keys.lanes_key, self.lanes)
        self.client.sadd(MODELS_KEY, self.keys.model)
        if limits is not None:
            self.client.set(self.keys.limits, limits.model_dump_json())
        if info is not None:
            self.publish_info(info)
        if tokenizer is not None:
            self.publish_tokenizer(tokenizer)
        if heartbeat_timeout_ms is not None:
            self.client.set(self.keys.heartbeat_timeout, heartbeat_timeout_ms)
        if max_depth:
            self.client.set(self.keys.max_depth, max_depth)
        else:
            self.client.delete(self.keys.max_depth)

    def publish_info(self, info: ModelInfo) -> None:
        """Write the model's info (no TTL, as the limits: each worker writes it when it
        starts), keeping the ``created`` of the info already there, if any."""
        raw = self.client.get(self.keys.info)
        if raw is not None:
            try:
                created = decode_model_info(raw).created
            except ValueError:  # not ours to read: replaced
                created = 0
            if 0 < created < info.created or not info.created:
                info = info.model_copy(update={"created": created})
        self.client.set(self.keys.info, info.model_dump_json())

    def publish_tokenizer(self, config: Mapping[str, Any]) -> None:
        """Write the model's tokenizer configuration (``/tokenizer_info``'s body; no TTL,
        as the info: each worker writes it when it starts)."""
        self.client.set(self.keys.tokenizer, json.dumps(config, separators=(",", ":")))

    def lora_loaded(self, name: str, path: str) -> None:
        """An adapter loaded while the model serves: workers started later load it too
        (every worker the broadcast reaches writes the same value)."""
        self.client.hset(self.keys.lora, name, path)

    def lora_unloaded(self, name: str) -> None:
        """An adapter unloaded while the model serves: workers started later do not serve
        it, not even from their fleet file (a tombstone, until it is loaded again)."""
        self.client.hset(self.keys.lora, name, LORA_UNLOADED)

    def loras(self) -> dict[str, str | None]:
        """The adapters loaded (name → directory) and unloaded (name → None) while the
        model serves."""
        raw = self.client.hgetall(self.keys.lora)
        return {_text(k): _text(v) if _text(v) != LORA_UNLOADED else None
                for k, v in raw.items()}  # fmt: skip

    def depths(self) -> tuple[list[int], list[int]]:
        """Entries in each lane stream, and how many of them are pending (being worked on)."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)
        replies = pipe.execute()
        return replies[0::2], [int(p["pending"]) for p in replies[1::2]]

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

    def read(self, counts: Mapping[int, int], block_ms: int | None) -> list[Entry]:
        """New entries for this consumer: up to ``counts[lane]`` from each lane (one round
        trip); if there are none and ``block_ms`` is set, block that long on all lanes."""
        pipe = self.client.pipeline(transaction=False)
        asked = [lane for lane, n in sorted(counts.items()) if n > 0]
        for lane in asked:
            pipe.xreadgroup(GROUP, self.consumer, {self.streams[lane]: ">"}, count=counts[lane])
        out = [e for reply in pipe.execute() for e in self._entries(reply)]
        if out or block_ms is None:
            return out
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

    def own_pending(self, limit: int = 10_000) -> list[tuple[int, str, int]]:
        """This consumer's pending entries: (lane, id, deliveries)."""
        out: list[tuple[int, str, int]] = []
        for lane, stream in enumerate(self.streams):
            for p in self.client.xpending_range(
                stream, GROUP, "-", "+", limit, consumername=self.consumer
            ):
                mid = p["message_id"]
                out.append((lane, mid.decode() if isinstance(mid, bytes) else str(mid),
                            int(p["times_delivered"])))  # fmt: skip
        return out

    def claim_own(self, items: Sequence[tuple[int, str, int]]) -> list[Entry]:
        """Deliver again entries pending on this consumer (a delivery is counted)."""
        out: list[Entry] = []
        by_lane: dict[int, dict[str, int]] = {}
        for lane, entry_id, deliveries in items:
            by_lane.setdefault(lane, {})[entry_id] = deliveries
        for lane, chosen in by_lane.items():
            stream = self.streams[lane]
            claimed: Any = self.client.xclaim(stream, GROUP, self.consumer, 0, list(chosen))
            for entry_id, fields in claimed:
                eid = entry_id.decode()
                if fields:
                    out.append(Entry(lane, eid, fields, chosen[eid] + 1))
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

    def append_tokens(self, items: Sequence[TokenWrite]) -> None:
        """Append entries to requests' token streams and publish the deltas' messages
        (encoded by the script): one ``tokens.lua`` call per ``TOKENS_CHUNK`` items, the
        items packed in one argument, called directly (a pipeline holding a script first
        asks SCRIPT EXISTS)."""
        for start in range(0, len(items), TOKENS_CHUNK):
            chunk = items[start : start + TOKENS_CHUNK]
            packed = msgpack.packb([it.item() for it in chunk])
            self._tokens(keys=[self.keys.tokens(it.request_id) for it in chunk],
                         args=[TOKENS_MAXLEN, packed])  # fmt: skip

    def tokens_commands(self, items: Sequence[TokenWrite]) -> list[bytes]:
        """:meth:`append_tokens` as packed ``EVALSHA`` commands, one per ``TOKENS_CHUNK``
        items, for a connection of the caller's own (worker/token_writes.py): packed here,
        a step's call costs a tenth of the client's argument encoding."""
        sha = self._tokens.sha.encode()
        out: list[bytes] = []
        for start in range(0, len(items), TOKENS_CHUNK):
            chunk = items[start : start + TOKENS_CHUNK]
            n = len(chunk)
            packed = msgpack.packb([it.item() for it in chunk])
            parts = [b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n$%d\r\n%d\r\n"
                     % (n + 5, len(sha), sha, len(str(n)), n)]  # fmt: skip
            for it in chunk:
                key = self.keys.tokens(it.request_id).encode()
                parts.append(b"$%d\r\n%s\r\n" % (len(key), key))
            parts.append(_TOKENS_MAXLEN_ARG)
            parts.append(b"$%d\r\n%s\r\n" % (len(packed), packed))
            out.append(b"".join(parts))
        return out

    def load_tokens_script(self) -> None:
        """Load ``tokens.lua`` (after ``NOSCRIPT``: a restarted or flushed Redis)."""
        self.client.script_load(self._tokens.script)

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

    def redis_time(self) -> float:
        """Redis server clock in unix seconds."""
        sec, usec = self.client.time()
        return sec + usec / 1e6


class RedisClock:
    """Local monotonic time mapped onto the Redis server's clock (stream ids use it).

    Reading it never touches Redis (any thread may, the device thread too); the intake
    calls :meth:`sync` on its own thread, at start and every ``refresh_s``. Before the first
    sync it is the local wall clock."""

    def __init__(self, streams: ModelStreams, refresh_s: float = 60.0) -> None:
        self._streams = streams
        self.refresh_s = refresh_s
        self._offset = time.time() - time.monotonic()
        self._synced = -math.inf

    def sync(self, force: bool = False) -> None:
        """Measure the offset to the Redis clock again, if due (or ``force``)."""
        t0 = time.monotonic()
        if not force and t0 - self._synced < self.refresh_s:
            return
        self._synced = t0  # one try per period, whatever the outcome
        server = self._streams.redis_time()
        t1 = time.monotonic()
        self._offset = server - (t0 + t1) / 2

    def __call__(self) -> float:
        return time.monotonic() + self._offset


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
