"""Each micro-batch as a Celery task in Flower: ``batchfleet.batch.<model>``.

The loop thread only appends to a bounded queue; one sender thread per worker publishes
through its own ``app.events.Dispatcher`` (its own connection, so the worker's buffered
dispatcher and the loop never wait on each other). Batches above ``max_batches_per_s`` are
sampled out (the rest still show), and nothing is sent while the worker's own task events
are disabled (``celery control disable_events``).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

from celery.signals import worker_ready

from ..batching.types import Batch
from ..config import EventsConfig, FleetConfig
from .observers import LoopObserver

logger = logging.getLogger(__name__)

_STOP = object()
COALESCE_S = 0.02
"""The sender thread waits this long after an event before sending: events are batched,
and it never takes the GIL right when a batch is being handed to the device."""


def batch_task_name(model: str) -> str:
    """Name under which a model's micro-batches show in Flower."""
    return f"batchfleet.batch.{model}"


def describe(batch: Batch) -> str:
    """Flower shows ``args`` verbatim: a tuple-looking one-line summary of the batch."""
    lanes: dict[int, int] = {}
    for w in batch.items:
        lanes[w.lane] = lanes.get(w.lane, 0) + w.size
    by_lane = ", ".join(f"{lane}: {n}" for lane, n in sorted(lanes.items()))
    return (
        f"('batch of {batch.rows} rows', {len(batch.items)} requests, lanes {{{by_lane}}}, "
        f"{batch.padded_tokens} padded tokens, reason {batch.reason!r})"
    )


@worker_ready.connect
def _explicit_event_groups(sender: Any = None, **_: Any) -> None:
    """A worker sending task events has event groups ``set()`` (all); Celery's
    ``disable_events`` only discards ``'task'`` from a non-empty set, so it would do
    nothing. Name the groups the worker sends, so disable/enable_events work."""
    dispatcher = getattr(sender, "event_dispatcher", None)
    if dispatcher is not None and dispatcher.enabled and not dispatcher.groups:
        dispatcher.groups = {"worker", "task"}


class EventSender:
    """A background thread publishing task events through a dedicated dispatcher."""

    def __init__(self, worker: Any, config: EventsConfig) -> None:
        self.app = worker.app
        self.worker = worker
        self.hostname: str = worker.hostname
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self.sent = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="bf-events", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def enabled(self) -> bool:
        """The worker's own task events are on (``enable_events`` / ``disable_events``)."""
        consumer = getattr(self.worker, "consumer", None)
        dispatcher = getattr(consumer, "event_dispatcher", None)
        if dispatcher is None or not dispatcher.enabled:
            return False
        groups = dispatcher.groups
        return not groups or "task" in groups

    def put(self, type_: str, fields: Mapping[str, Any]) -> None:
        try:
            self.queue.put_nowait((type_, dict(fields, timestamp=time.time())))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout``), then stop the thread."""
        if self._thread.is_alive():
            try:
                self.queue.put(_STOP, timeout=timeout)
            except queue.Full:
                return
            self._thread.join(timeout)

    def _dispatcher(self) -> Any:
        return self.app.events.Dispatcher(
            connection=self.app.connection_for_write(), hostname=self.hostname, enabled=True
        )

    def _run(self) -> None:
        dispatcher = None
        while True:
            first = self.queue.get()
            if first is not _STOP:
                # Let the batch that caused it start (and its results go out) before this
                # thread wants the GIL; then send everything queued meanwhile at once.
                time.sleep(COALESCE_S)
            items = [first]
            while items[-1] is not _STOP:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is _STOP:
                    break
                dispatcher = self._send(dispatcher, *item)
            if items[-1] is _STOP:
                break
        _close(dispatcher)

    def _send(self, dispatcher: Any, type_: str, fields: dict[str, Any]) -> Any:
        """Send one event; returns the dispatcher to use next (None after a failure)."""
        try:
            if dispatcher is None:
                dispatcher = self._dispatcher()
            dispatcher.send(type_, **fields)
            self.sent += 1
        except Exception as exc:  # broker down: drop the event, reconnect later
            self.dropped += 1
            logger.warning("flower event %s not sent: %s", type_, exc)
            _close(dispatcher)
            dispatcher = None
            time.sleep(0.5)
        return dispatcher


def _close(dispatcher: Any) -> None:
    if dispatcher is None:
        return
    try:
        dispatcher.close()
        dispatcher.connection.release()
    except Exception:
        pass


class FlowerEvents(LoopObserver):
    """Reports a model's micro-batches as tasks: received + started on dispatch, then
    succeeded (or failed when no request in it was answered ok) with the run time."""

    def __init__(self, sender: EventSender, model: str, config: EventsConfig) -> None:
        self.sender = sender
        self.name = batch_task_name(model)
        self.min_gap = 1.0 / config.max_batches_per_s
        self._next = 0.0
        self._reported: set[str] = set()
        self.sampled_out = 0

    def on_dispatch(self, model: str, batch: Batch, batch_id: str, now: float) -> None:
        mono = time.monotonic()
        if mono < self._next or not self.sender.enabled():
            self.sampled_out += 1
            return
        self._next = mono + self.min_gap
        self._reported.add(batch_id)
        args = describe(batch)
        kwargs = (
            f"{{'rows': {batch.rows}, 'requests': {len(batch.items)}, "
            f"'padded_tokens': {batch.padded_tokens}, 'reason': {batch.reason!r}}}"
        )
        self.sender.put(
            "task-received",
            {"uuid": batch_id, "name": self.name, "args": args, "kwargs": kwargs, "retries": 0,
             "eta": None, "root_id": batch_id, "parent_id": None},
        )  # fmt: skip
        self.sender.put("task-started", {"uuid": batch_id})

    def on_batch_done(
        self,
        model: str,
        batch: Batch,
        batch_id: str,
        seconds: float,
        out_of_memory: bool,
        failed: int,
    ) -> None:
        if batch_id not in self._reported:
            return
        self._reported.discard(batch_id)
        if failed >= len(batch.items):
            reason = "out of memory" if out_of_memory else "inference failed"
            self.sender.put(
                "task-failed",
                {"uuid": batch_id, "exception": f"{reason} for all {failed} requests",
                 "traceback": "", "runtime": seconds},
            )  # fmt: skip
            return
        result = f"'{batch.rows} rows, {failed} failed requests'"
        self.sender.put("task-succeeded", {"uuid": batch_id, "result": result, "runtime": seconds})


def flower_events(worker: Any, fleet: FleetConfig, model: str) -> LoopObserver:
    """Observer factory for ``app.batchfleet_observers`` (one sender thread per worker)."""
    if not fleet.events.enabled:
        return LoopObserver()
    sender = getattr(worker, "_batchfleet_events", None)
    if sender is None:
        sender = EventSender(worker, fleet.events)
        worker._batchfleet_events = sender
    return FlowerEvents(sender, model, fleet.events)
