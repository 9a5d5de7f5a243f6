"""Flower batch events in-process: per batch, sampled, honouring disable_events, never blocking."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from batchfleet.batching.types import Batch, Waiting
from batchfleet.worker.events import EventSender, FlowerEvents, describe

from batchfleet.config import EventsConfig


class FakeSender:
    """Stands in for EventSender: records instead of publishing."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.on = True

    def enabled(self) -> bool:
        return self.on

    def put(self, type_: str, fields: dict[str, Any]) -> None:
        self.sent.append((type_, fields))


def batch(rows: int, lane: int = 0) -> Batch:
    items = tuple(Waiting(key=f"{lane}/{i}", lane=lane, arrived=0.0, tokens=5) for i in range(rows))
    return Batch(items, "window")


def test_each_batch_is_one_task_with_its_size_in_args() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=1e6))  # type: ignore[arg-type]
    b = batch(4)
    obs.on_dispatch("tiny", b, "b1", 0.0)
    obs.on_batch_done("tiny", b, "b1", 0.02, False, 0)
    assert [t for t, _ in sender.sent] == ["task-received", "task-started", "task-succeeded"]
    received = sender.sent[0][1]
    assert received["name"] == "batchfleet.batch.tiny" and received["uuid"] == "b1"
    assert "'batch of 4 rows'" in received["args"] and "20 padded tokens" in received["args"]
    assert sender.sent[2][1]["runtime"] == 0.02


def test_a_batch_where_every_request_failed_is_a_failed_task() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig())  # type: ignore[arg-type]
    b = batch(2)
    obs.on_dispatch("tiny", b, "b1", 0.0)
    obs.on_batch_done("tiny", b, "b1", 0.5, True, 2)
    assert sender.sent[-1][0] == "task-failed"
    assert "out of memory" in sender.sent[-1][1]["exception"]


def test_above_the_rate_batches_are_sampled_and_pairs_stay_whole() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=2))  # type: ignore[arg-type]
    for i in range(100):  # 100 batches at once: one is reported
        obs.on_dispatch("tiny", batch(1), f"b{i}", 0.0)
        obs.on_batch_done("tiny", batch(1), f"b{i}", 0.001, False, 0)
    assert [t for t, _ in sender.sent] == ["task-received", "task-started", "task-succeeded"]
    assert obs.sampled_out == 99


def test_nothing_is_sent_while_the_workers_task_events_are_disabled() -> None:
    sender = FakeSender()
    sender.on = False
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=1e6))  # type: ignore[arg-type]
    obs.on_dispatch("tiny", batch(3), "b1", 0.0)
    obs.on_batch_done("tiny", batch(3), "b1", 0.01, False, 0)
    assert sender.sent == []


def test_sender_follows_the_workers_own_dispatcher() -> None:
    dispatcher = SimpleNamespace(enabled=True, groups={"task", "worker"})
    worker = SimpleNamespace(
        app=SimpleNamespace(), hostname="w@h", consumer=SimpleNamespace(event_dispatcher=dispatcher)
    )
    sender = EventSender(worker, EventsConfig())
    try:
        assert sender.enabled()
        dispatcher.groups = {"worker"}  # task events off, heartbeats on
        assert not sender.enabled()
        dispatcher.groups, dispatcher.enabled = {"task"}, False  # celery control disable_events
        assert not sender.enabled()
    finally:
        sender.close(0.5)


def test_a_full_queue_drops_instead_of_blocking_the_loop() -> None:
    worker = SimpleNamespace(app=SimpleNamespace(), hostname="w@h", consumer=None)
    sender = EventSender(worker, EventsConfig(queue_size=3))
    sender.queue.put_nowait(("block", {}))  # keep the thread busy failing to connect
    started = time.monotonic()
    for _ in range(1000):
        sender.put("task-started", {"uuid": "x"})
    assert time.monotonic() - started < 0.5
    assert sender.dropped >= 990
    sender.close(0.1)


def test_describe_names_lanes_tokens_and_reason() -> None:
    b = Batch((*batch(2, lane=0).items, *batch(3, lane=2).items), "full")
    text = describe(b)
    assert text.startswith("('batch of 5 rows'") and "lanes {0: 2, 2: 3}" in text
    assert "reason 'full'" in text
