"""The operations a producer core yields, and the loop helper both shells drive them with.

A core generator (producer/core.py) yields these, receives each one's reply, and returns its
value; a connection error is thrown back into it at the ``yield``. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis

from ..schemas.messages import Result

DOWN = (redis.ConnectionError, redis.TimeoutError)
"""What a restarting Redis raises (``BusyLoadingError`` while it loads is a ConnectionError)."""


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
    """Not a Redis operation: hand this result to the caller of ``results()``."""

    result: Result


Op = Get | GetMany | RunScript | Sleep | Subscribe | Listen | Unsubscribe | Emit
T = TypeVar("T")
Steps = Generator[Op, Any, T]
"""A core operation: yields :data:`Op`, receives each one's reply, returns a ``T``."""


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
