"""A batch loop's collaborators, behind small protocols so tests can replace them.

Production wires the Redis intake and sink, a device thread and the Redis server's clock
(:func:`redis_parts`); ``tests/virtual_world.py`` wires scripted ones in virtual time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import ModelConfig, WorkerConfig
from .cancels import CancelWatch
from .control import restore_loras
from .deltas import DeltaWriter
from .executor import Executor
from .holding import Holding
from .inbox import Inbox, ThreadInbox, Wake
from .intake import Intake
from .observers import Observers
from .redis_clock import RedisClock
from .runner import Runner, Work, is_continuous
from .runner_info import model_info
from .sink import RedisSink, ResultSink
from .streams import Entry, ModelStreams
from .tokenizer_info import tokenizer_info


class Source(Protocol):
    """What the loop needs from its intake (the Redis one, or a scripted one in tests)."""

    def start(self, max_depth: int | None) -> None: ...
    def grant(self, counts: dict[int, int], suspects: bool, seen: int) -> None: ...
    def hold(self, holding: Holding) -> None: ...
    def hung_for(self) -> float | None: ...
    def stop(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def release(self, entries: Sequence[Entry]) -> None: ...
    def unregister(self) -> None: ...


class Watch(Protocol):
    """What the loop needs from its cancel watcher (generating models only)."""

    def start(self) -> None: ...
    def watch(self, request_ids: Collection[str]) -> None: ...
    def stop(self) -> None: ...


class Device(Protocol):
    """What the loop needs from its executor."""

    def start(self) -> None: ...
    def submit(self, work: Work) -> None: ...
    def drop_queued(self) -> list[Work]: ...
    def close(self, timeout: float | None = None) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    @property
    def alive(self) -> bool: ...
    @property
    def crashed_in_a_row(self) -> int: ...


@dataclass
class Parts:
    """A loop's collaborators, injectable (tests run them in virtual time)."""

    clock: Callable[[], float]
    inbox: Inbox
    source: Source
    device: Device
    sink: ResultSink
    cancels: Watch | None = None
    """Polls client cancellations (generating runners only)."""
    deltas: DeltaWriter | None = None
    """Streams deltas from the device thread (generating runners only; the device posts
    its steps through it)."""


def redis_parts(
    streams: ModelStreams,
    runner: Runner,
    config: ModelConfig,
    worker: WorkerConfig,
    observers: Observers,
    model: str,
) -> Parts:
    """The production parts: Redis intake and sink, a device thread, the Redis clock."""
    restore_loras(streams, runner, model)  # before the info lists the adapters
    inbox = ThreadInbox()
    clock = RedisClock(streams)
    source = Intake(
        streams, worker, config.limits, clock, inbox.put, sync_clock=clock.sync,
        check_cancels=is_continuous(runner), name=f"intake-{model}",
        info=model_info(runner, config.limits, int(time.time()), config),
        tokenizer=tokenizer_info(runner),
    )  # fmt: skip
    sink = RedisSink(
        streams, observers, lambda: inbox.put(Wake()),
        dead_letter_maxlen=worker.dead_letter_maxlen,
        release_idle_ms=worker.claim_idle_ms, settled=source.settled, name=f"sink-{model}",
    )  # fmt: skip
    if not is_continuous(runner):
        device = Executor(runner, clock, inbox.put, name=f"device-{model}")
        return Parts(clock, inbox, source, device, sink)
    # a step's deltas leave before its end
    deltas = DeltaWriter(sink.stream_now, inbox.put, suspect=source.suspect)
    device = Executor(runner, clock, deltas.post, name=f"device-{model}")
    cancels = CancelWatch(streams, inbox.put, name=f"cancels-{model}")
    return Parts(clock, inbox, source, device, sink, cancels, deltas)
