"""Reading a generating request's token stream (``bf:{model}:tokens:<id>``), sans I/O.

The worker appends one entry per delta (flat fields ``seq``, ``input``, ``text``,
``tokens``) and, once the result is stored, an entry ``{seq, end: "1"}``
(docs/protocol.md, "Text generation"). :func:`read_tokens` follows it with ``XREAD BLOCK``
from the last entry id seen, so a reader that reconnects (or starts late) misses nothing,
and hands each delta to a :class:`Follower`, which decides what the caller gets: every
:class:`~batchfleet.schemas.messages.Delta` (``job.deltas()``) or the text of a one-input
request (``job.stream()``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from ..schemas.codec import decode_result
from ..schemas.errors import ResultTimeout, StreamRestarted
from ..schemas.keys import ModelKeys
from ..schemas.messages import Delta
from .gaps import Gaps
from .ops import DOWN, Emit, Get, Sleep, Steps, XRead
from .submit import unavailable

logger = logging.getLogger(__name__)

BLOCK_S = 1.0
"""Longest ``XREAD BLOCK``; after each empty one the reader checks for a stored result."""
END_GRACE_S = 0.25
"""Once the result is stored, the end entry is due at once; a stream that stays quiet this
long after it is done as well (its worker died between storing and the end entry)."""
RECONNECT_PAUSE_S = 0.2


@dataclass(frozen=True, slots=True)
class Restarted:
    """Another worker generates the request again from the start (the one generating it
    died): the deltas before this are void; the next one has ``seq`` 1."""

    id: str


class Follower(Protocol):
    """Turns token-stream events into what a reader's caller gets (None: nothing)."""

    def feed(self, event: Delta | Restarted) -> Any | None: ...

    def end(self) -> None:
        """The stream ended."""


class DeltaFollower:
    """``job.deltas()``: every delta, and a :class:`Restarted` marker on a restart."""

    def feed(self, event: Delta | Restarted) -> Delta | Restarted:
        return event

    def end(self) -> None:
        pass


Part = Literal["text", "content", "reasoning_content"]
"""What ``job.stream()`` yields: the text as generated, or its answer (a reasoning
model's without its reasoning; a request with tools without the calls' markup), or its
reasoning."""


class TextFollower:
    """``job.stream()``: the text (or its ``part``) of a one-input request, piece by piece.

    After a restart, the text generated again is checked against what was already yielded:
    while it repeats it (greedy and seeded decoding do), nothing is yielded twice and the
    stream goes on past it; if it differs, :class:`StreamRestarted` is raised.
    """

    def __init__(self, request_id: str, part: Part = "text") -> None:
        self.request_id = request_id
        self.part = part
        self.sent = ""
        self.again: str | None = None
        """Text regenerated since a restart, while it has not caught up with ``sent``."""

    def feed(self, event: Delta | Restarted) -> str | None:
        if isinstance(event, Restarted):
            self.again = ""
            return None
        if event.input != 0:
            raise ValueError(
                f"request {self.request_id} has several inputs: read it with job.deltas()"
            )
        piece = event.text
        if self.part != "text":  # a delta without the field: all text is answer
            got = getattr(event, self.part)
            piece = got if got is not None else piece if self.part == "content" else ""
        if self.again is None:
            self.sent += piece
            return piece or None
        self.again += piece
        if not (self.sent.startswith(self.again) or self.again.startswith(self.sent)):
            raise self._diverged()
        if len(self.again) <= len(self.sent):
            return None
        new, self.sent, self.again = self.again[len(self.sent) :], self.again, None
        return new

    def end(self) -> None:
        if self.again is not None and self.again != self.sent:
            raise self._diverged()

    def _diverged(self) -> StreamRestarted:
        return StreamRestarted(
            f"request {self.request_id} was restarted by another worker and generated a "
            "different text: the text streamed so far is void; job.result() has the final one",
            self.request_id,
        )


END: Final = object()
"""What :func:`parse_entry` returns for the end entry."""


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_entry(keys: ModelKeys, request_id: str, fields: dict[Any, Any]) -> Delta | object | None:
    """A token-stream entry as a :class:`Delta`, :data:`END`, or None (not one we know)."""
    flat = {_str(k): v for k, v in fields.items()}
    if "end" in flat:
        return END
    try:
        return Delta(
            id=request_id,
            model=keys.model,
            seq=int(flat["seq"]),
            input=int(flat.get("input", 0)),
            text=_str(flat.get("text", b"")),
            tokens=int(flat.get("tokens", 0)),
            logprobs=json.loads(flat["logprobs"]) if "logprobs" in flat else None,
            tool_calls=json.loads(flat["tool_calls"]) if "tool_calls" in flat else None,
            tool_call_chunks=json.loads(flat["tool_call_chunks"])
            if "tool_call_chunks" in flat
            else None,
            token_ids=json.loads(flat["token_ids"]) if "token_ids" in flat else None,
            content=_str(flat["content"]) if "content" in flat else None,
            reasoning_content=_str(flat["reasoning_content"])
            if "reasoning_content" in flat
            else None,
            prompt_tokens=int(flat["prompt_tokens"]) if "prompt_tokens" in flat else None,
            prompt_text=_str(flat["prompt_text"]) if "prompt_text" in flat else None,
            prompt_logprobs=json.loads(flat["prompt_logprobs"])
            if "prompt_logprobs" in flat
            else None,
            prompt_token_ids=json.loads(flat["prompt_token_ids"])
            if "prompt_token_ids" in flat
            else None,
        )
    except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def read_tokens(
    url: str, model: str, request_id: str, timeout: float | None, follower: Follower
) -> Steps[None]:
    """Follow the token stream of ``request_id`` until its end entry (or its stored result
    and a quiet stream); :class:`Emit` what ``follower`` makes of each delta.

    A ``seq`` not above the last one seen means the request restarted: the follower gets
    :class:`Restarted` first; so does an end entry's (the attempt that ended the request
    streamed nothing: taken over past its deadline, say, its text empty). A delta whose
    ``seq`` is not above the last one's but above 1, with the same ``life``, is a repeat,
    skipped: the same attempt's write made again (its master failed over before the worker
    had the answer, and the replica promoted never had the write). ``seq`` 1 is always a
    restart: a request handed back uncounted (a stopped worker's) keeps its ``life``, so
    only an attempt's first ``seq`` tells its next attempt apart. A ``seq`` skipped
    (deltas lost with a failed-over master) holds the deltas after it back; once the stream
    ends, the rest of each output comes from the result (:mod:`.gaps`). Through a Redis
    outage it keeps trying until ``timeout``, then raises :class:`Unavailable`; with Redis
    up, :class:`ResultTimeout`.
    """
    keys = ModelKeys(model)
    stream, result_key = keys.tokens(request_id), keys.result(request_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    after, last_seq = "0-0", 0
    last_life: int | None = None
    gaps = Gaps()
    stored = False
    down: Exception | None = None
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            if down is not None:
                raise unavailable(url, down)
            raise ResultTimeout(f"token stream of {request_id} not finished within {timeout}s")
        block = END_GRACE_S if stored else BLOCK_S
        try:
            entries = yield XRead(stream, after, block if left is None else min(block, left))
            if not entries and not stored:
                stored = (yield Get(result_key)) is not None
                if stored:
                    continue  # one more read, to the end entry or a quiet END_GRACE_S
            down = None
        except DOWN as exc:
            if down is None:
                logger.warning("Redis unreachable reading %s (%s); retrying", stream, exc)
            down = exc
            yield Sleep(RECONNECT_PAUSE_S if left is None else min(RECONNECT_PAUSE_S, left))
            continue
        if stored and not entries:
            yield from _filled(url, result_key, deadline, gaps, follower)
            follower.end()
            return
        for entry_id, fields in entries:
            after = _str(entry_id)
            event = parse_entry(keys, request_id, fields)
            if event is END:
                if _seq(fields) <= last_seq:  # an attempt that streamed nothing ended it
                    gaps.restart()
                    yield from _emit(follower.feed(Restarted(request_id)))
                gaps.lost |= _seq(fields) > last_seq + 1
                yield from _filled(url, result_key, deadline, gaps, follower)
                follower.end()
                return
            if not isinstance(event, Delta):
                continue
            life = _life(fields)
            if 1 < event.seq <= last_seq and life is not None and life == last_life:
                continue  # a repeat: its write was made again across a failover
            last_life = life
            if event.seq <= last_seq:
                gaps.restart()
                yield from _emit(follower.feed(Restarted(request_id)))
            elif event.seq > last_seq + 1 and not gaps.lost:
                gaps.lost = True
                logger.warning("%s lost deltas %d-%d (a failover?): the rest comes from its "
                               "result", stream, last_seq + 1, event.seq - 1)  # fmt: skip
            last_seq = event.seq
            if not gaps.lost:
                gaps.emitted(event)
                yield from _emit(follower.feed(event))


def _filled(
    url: str, key: str, deadline: float | None, gaps: Gaps, follower: Follower
) -> Steps[None]:
    """Where the stream skipped a ``seq``: the deltas that complete it from the result
    (:mod:`.gaps`); a restart and the result's whole outputs where
    they do not continue what was emitted."""
    if not gaps.lost:
        return
    raw = yield from _result(url, key, deadline)
    if raw is None:
        return
    result = decode_result(raw)
    deltas = gaps.fill(result)
    if deltas is None:
        yield from _emit(follower.feed(Restarted(result.id)))
        gaps.restart()
        deltas = gaps.fill(result) or []
    for delta in deltas:
        yield from _emit(follower.feed(delta))


def _result(url: str, key: str, deadline: float | None) -> Steps[bytes | None]:
    """The stored result (through an outage until ``deadline``)."""
    while True:
        try:
            raw: bytes | None = yield Get(key)
            return raw
        except DOWN as exc:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise unavailable(url, exc) from exc
            yield Sleep(RECONNECT_PAUSE_S if left is None else min(RECONNECT_PAUSE_S, left))


def _life(fields: dict[Any, Any]) -> int | None:
    """An entry's ``life``: the attempt that wrote it (None where it has none: workers
    before the field)."""
    raw = fields.get(b"life", fields.get("life"))
    try:
        return None if raw is None else int(raw)
    except (TypeError, ValueError):
        return None


def _seq(fields: dict[Any, Any]) -> int:
    """An entry's ``seq`` (0 where it has none, or not a number)."""
    raw = fields.get(b"seq", fields.get("seq", 0))
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def _emit(item: Any | None) -> Steps[None]:
    if item is not None:
        yield Emit(item)
