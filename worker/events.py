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
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import uuid4

from celery.signals import worker_ready

from ..batching.types import Batch
from ..config import EventsConfig, FleetConfig
from .observers import (
    BatchDone,
    Dispatched,
    Expired,
    Generated,
    LoopEvent,
    LoopObserver,
    NullObserver,
    StateChanged,
)

logger = logging.getLogger(__name__)

_STOP = object()
COALESCE_S = 0.02
"""The sender thread waits this long after an event before sending: events are batched,
and it never takes the GIL right when a batch is being handed to the device."""


def batch_task_name(model: str) -> str:
    """Name under which a model's micro-batches show in Flower."""
    return f"batchfleet.batch.{model}"


def describe(batch: Batch) -> str:
    """Flower shows ``args`` verbatim: a tuple-looking one-line summary of the batch (for a
    generating model, of the requests a step admits)."""
    lanes: dict[int, int] = {}
    for w in batch.items:
        lanes[w.lane] = lanes.get(w.lane, 0) + w.size
    by_lane = ", ".join(f"{lane}: {n}" for lane, n in sorted(lanes.items()))
    if batch.reason == "step":
        return (
            f"('admit {len(batch.items)} requests', {batch.rows} sequences, lanes "
            f"{{{by_lane}}}, {batch.real_tokens} prompt tokens)"
        )
    return (
        f"('batch of {batch.rows} rows', {len(batch.items)} requests, lanes {{{by_lane}}}, "
        f"{batch.padded_tokens} padded tokens, reason {batch.reason!r})"
    )


def describe_state(admitted: int, g: Generated) -> str:
    """A generating step's task result: what it admitted and the running batch after it."""
    kv = g.kv_tokens / g.kv_capacity if g.kv_capacity else 0.0
    return (
        f"'{admitted} requests admitted; then {g.running} sequences running, {g.waiting} "
        f"requests waiting; {g.tokens} tokens this step; KV cache {kv:.0%}'"
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


MAX_IDS_SHOWN = 16
"""Request ids listed in a Flower task's kwargs (the rest are counted)."""


def _ids(request_ids: Sequence[str]) -> str:
    shown = list(request_ids[:MAX_IDS_SHOWN])
    more = len(request_ids) - len(shown)
    return repr(shown) + (f" + {more} more" if more > 0 else "")


class FlowerEvents:
    """Reports a model's micro-batches as tasks: received + started on dispatch, then
    succeeded (or failed when every request in it failed) with the run time. Requests
    answered ``expired`` in a planning round show as one failed task, so expiries and shed
    load are visible in Flower too; so are pause, drain and resume. A generating model's
    task is a step that admits requests: its result is the running batch after it (from
    the :class:`Generated` event that follows its :class:`BatchDone`)."""

    def __init__(self, sender: EventSender, model: str, config: EventsConfig) -> None:
        self.sender = sender
        self.model = model
        self.name = batch_task_name(model)
        self.min_gap = 1.0 / config.max_batches_per_s
        self._next = 0.0
        self._next_expiry = 0.0
        self._reported: set[str] = set()
        self._step: BatchDone | None = None
        """A generating step's end, reported with the state after it (next event)."""
        self.sampled_out = 0

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, Dispatched):
            self._dispatched(event)
        elif isinstance(event, BatchDone):
            self._done(event)
        elif isinstance(event, Expired):
            self._expired(event)
        elif isinstance(event, StateChanged):
            self._state(event)
        elif isinstance(event, Generated) and self._step is not None:
            done, self._step = self._step, None
            self._succeeded(done, describe_state(len(done.batch.items), event))

    def _dispatched(self, ev: Dispatched) -> None:
        if ev.batch.reason == "step" and not ev.batch.items:
            return  # a generator's decode step that admits nothing: a task per request joining
        mono = time.monotonic()
        if mono < self._next or not self.sender.enabled():
            self.sampled_out += 1
            return
        self._next = mono + self.min_gap
        self._reported.add(ev.batch_id)
        batch = ev.batch
        if batch.reason == "step":
            kwargs = (
                f"{{'requests': {len(batch.items)}, 'sequences': {batch.rows}, "
                f"'prompt_tokens': {batch.real_tokens}, 'request_ids': {_ids(ev.request_ids)}}}"
            )
        else:
            kwargs = (
                f"{{'rows': {batch.rows}, 'requests': {len(batch.items)}, "
                f"'padded_tokens': {batch.padded_tokens}, 'reason': {batch.reason!r}, "
                f"'request_ids': {_ids(ev.request_ids)}}}"
            )
        self._received(ev.batch_id, describe(batch), kwargs)

    def _received(self, uuid: str, args: str, kwargs: str) -> None:
        self.sender.put(
            "task-received",
            {"uuid": uuid, "name": self.name, "args": args, "kwargs": kwargs, "retries": 0,
             "eta": None, "root_id": uuid, "parent_id": None},
        )  # fmt: skip
        self.sender.put("task-started", {"uuid": uuid})

    def _done(self, ev: BatchDone) -> None:
        if ev.batch_id not in self._reported:
            return
        self._reported.discard(ev.batch_id)
        if ev.failed >= len(ev.batch.items):
            reason = "out of memory" if ev.out_of_memory else "inference failed"
            self.sender.put(
                "task-failed",
                {"uuid": ev.batch_id, "exception": f"{reason} for all {ev.failed} requests",
                 "traceback": "", "runtime": ev.seconds},
            )  # fmt: skip
            return
        if ev.batch.reason == "step":
            self._step = ev  # answered with the state the next event brings
            return
        self._succeeded(ev, f"'{ev.batch.rows} rows, {ev.failed} failed requests'")

    def _succeeded(self, ev: BatchDone, result: str) -> None:
        self.sender.put(
            "task-succeeded", {"uuid": ev.batch_id, "result": result, "runtime": ev.seconds}
        )

    def _expired(self, ev: Expired) -> None:
        mono = time.monotonic()
        if mono < self._next_expiry or not self.sender.enabled():
            self.sampled_out += 1
            return
        self._next_expiry = mono + self.min_gap
        uuid = f"expired-{uuid4().hex[:12]}"
        lanes: dict[int, int] = {}
        for lane in ev.lanes:
            lanes[lane] = lanes.get(lane, 0) + 1
        by_lane = ", ".join(f"{lane}: {n}" for lane, n in sorted(lanes.items()))
        args = f"('{len(ev.request_ids)} requests expired', lanes {{{by_lane}}})"
        self._received(uuid, args, f"{{'request_ids': {_ids(ev.request_ids)}}}")
        self.sender.put(
            "task-failed",
            {"uuid": uuid, "exception": f"deadline_exceeded: {len(ev.request_ids)} requests "
             "expired before they could be computed (not run)", "traceback": "", "runtime": 0.0},
        )  # fmt: skip

    def _state(self, ev: StateChanged) -> None:
        if not self.sender.enabled():
            return
        uuid = f"state-{uuid4().hex[:12]}"
        self._received(uuid, f"('model {self.model} {ev.state}',)", "{}")
        self.sender.put("task-succeeded", {"uuid": uuid, "result": repr(ev.state), "runtime": 0.0})


def flower_events(worker: Any, fleet: FleetConfig, model: str) -> LoopObserver:
    """Observer factory for ``app.batchfleet_observers`` (one sender thread per worker)."""
    if not fleet.events.enabled:
        return NullObserver()
    sender = getattr(worker, "_batchfleet_events", None)
    if sender is None:
        sender = EventSender(worker, fleet.events)
        worker._batchfleet_events = sender
    return FlowerEvents(sender, model, fleet.events)
