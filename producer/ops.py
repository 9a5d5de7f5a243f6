"""The operations a producer core yields, and the loop helper both shells drive them with.

A core generator (producer/core.py) yields these, receives each one's reply, and returns its
value; a connection error is thrown back into it at the ``yield``. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..redis_errors import UNREACHABLE

DOWN = UNREACHABLE
"""What a restarting Redis raises (``BusyLoadingError`` while it loads is a ConnectionError),
and a Redis Cluster that no node answers (:mod:`batchfleet.redis_errors`)."""


# --- the operations a core generator yields --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Get:
    """``GET key`` → bytes or None."""

    key: str


@dataclass(frozen=True, slots=True)
class GetMany:
    """``GET`` each key on one pipeline → a list of bytes or None."""

    keys: list[str]


@dataclass(frozen=True, slots=True)
class RunScript:
    """The submit script once per ``(keys, args)``, pipelined → replies, errors as objects."""

    calls: list[tuple[list[str], list[bytes]]]


@dataclass(frozen=True, slots=True)
class SetEx:
    """``SET key value EX ttl_s`` → True."""

    key: str
    value: bytes
    ttl_s: int


@dataclass(frozen=True, slots=True)
class XRead:
    """``XREAD COUNT count [BLOCK ms] STREAMS key after`` → a list of ``(entry id, fields)``
    (empty when none came); ``block_s`` None does not block."""

    key: str
    after: str
    block_s: float | None
    count: int = 512


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Open a fresh subscription to ``channel`` (closing any earlier one)."""

    channel: str


@dataclass(frozen=True, slots=True)
class Listen:
    """The next message's data on the subscription, or None after ``timeout`` seconds."""

    timeout: float


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """Close the subscription (its connection may be dead)."""


@dataclass(frozen=True, slots=True)
class Emit:
    """Not a Redis operation: hand ``item`` to the caller (a result of ``results()``, a
    delta or text of a token stream)."""

    item: Any


Op = Get | GetMany | RunScript | SetEx | XRead | Sleep | Subscribe | Listen | Unsubscribe | Emit
T = TypeVar("T")
Steps = Generator[Op, Any, T]
"""A core operation: yields :data:`Op`, receives each one's reply, returns a ``T``."""


def block_ms(op: XRead) -> int | None:
    """``op``'s ``BLOCK`` argument (never 0: that blocks for ever)."""
    return None if op.block_s is None else max(1, int(op.block_s * 1000))


def stream_entries(reply: Any) -> list[tuple[Any, Any]]:
    """The entries of an ``XREAD`` reply for one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    out: list[tuple[Any, Any]] = []
    for entries in reply.values() if isinstance(reply, dict) else [e for _, e in reply]:
        if entries and isinstance(entries[0], list):  # RESP3, as redis-py wraps it
            entries = entries[0]
        out += [(eid, fields) for eid, fields in entries if fields is not None]
    return out


class Runner(Generic[T]):
    """Feeds a core generator the replies to its operations: the part of a shell's loop that
    is not I/O. Iterate it for the operations, set ``reply`` after each (a connection error
    as the exception object: it is raised in the core at its ``yield``); then ``value`` is
    the generator's return value."""

    def __init__(self, steps: Generator[Op, Any, T]) -> None:
        self.steps = steps
        self.reply: Any = None
        self.value: T | None = None

    def __iter__(self) -> Iterator[Op]:
        try:
            while True:
                reply, self.reply = self.reply, None
                if isinstance(reply, DOWN):
                    yield self.steps.throw(reply)
                else:
                    yield self.steps.send(reply)
        except StopIteration as stop:
            self.value = stop.value
        finally:
            self.steps.close()
