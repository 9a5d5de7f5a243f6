"""Flower batch events in-process: per batch, sampled, honouring disable_events, never blocking."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from batchfleet.batching.types import Batch, Waiting
from batchfleet.worker.events import MAX_IDS_SHOWN, EventSender, FlowerEvents, describe
from batchfleet.worker.observers import BatchDone, Dispatched, Expired, Generated, StateChanged

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


def ids(b: Batch) -> tuple[str, ...]:
    return tuple(f"req-{w.key}" for w in b.items)


def dispatched(obs: FlowerEvents, b: Batch, batch_id: str) -> None:
    obs.notify(Dispatched("tiny", b, batch_id, ids(b), 0.0))


def done(
    obs: FlowerEvents, b: Batch, batch_id: str, seconds: float, oom: bool, failed: int
) -> None:
    obs.notify(BatchDone("tiny", b, batch_id, ids(b), seconds, oom, failed))


def test_each_batch_is_one_task_with_its_size_in_args() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=1e6))  # type: ignore[arg-type]
    b = batch(4)
    dispatched(obs, b, "b1")
    done(obs, b, "b1", 0.02, False, 0)
    assert [t for t, _ in sender.sent] == ["task-received", "task-started", "task-succeeded"]
    received = sender.sent[0][1]
    assert received["name"] == "batchfleet.batch.tiny" and received["uuid"] == "b1"
    assert "'batch of 4 rows'" in received["args"] and "20 padded tokens" in received["args"]
    assert "'request_ids': ['req-0/0', 'req-0/1', 'req-0/2', 'req-0/3']" in received["kwargs"]
    assert sender.sent[2][1]["runtime"] == 0.02


def test_a_batch_where_every_request_failed_is_a_failed_task() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig())  # type: ignore[arg-type]
    b = batch(2)
    dispatched(obs, b, "b1")
    done(obs, b, "b1", 0.5, True, 2)
    assert sender.sent[-1][0] == "task-failed"
    assert "out of memory" in sender.sent[-1][1]["exception"]


def test_above_the_rate_batches_are_sampled_and_pairs_stay_whole() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=2))  # type: ignore[arg-type]
    for i in range(100):  # 100 batches at once: one is reported
        dispatched(obs, batch(1), f"b{i}")
        done(obs, batch(1), f"b{i}", 0.001, False, 0)
    assert [t for t, _ in sender.sent] == ["task-received", "task-started", "task-succeeded"]
    assert obs.sampled_out == 99


def test_nothing_is_sent_while_the_workers_task_events_are_disabled() -> None:
    sender = FakeSender()
    sender.on = False
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=1e6))  # type: ignore[arg-type]
    dispatched(obs, batch(3), "b1")
    done(obs, batch(3), "b1", 0.01, False, 0)
    obs.notify(Expired("tiny", ("a",), (0,), 0.0))
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


def test_a_big_batch_lists_a_bounded_number_of_request_ids() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=1e6))  # type: ignore[arg-type]
    dispatched(obs, batch(100), "b1")
    kwargs = sender.sent[0][1]["kwargs"]
    assert kwargs.count("req-") == MAX_IDS_SHOWN and f"+ {100 - MAX_IDS_SHOWN} more" in kwargs


def test_expired_requests_show_as_a_failed_task_with_their_ids() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=1e6))  # type: ignore[arg-type]
    obs.notify(Expired("tiny", ("a", "b", "c"), (0, 2, 2), 0.0))
    kinds = [t for t, _ in sender.sent]
    assert kinds == ["task-received", "task-started", "task-failed"]
    received, failed = sender.sent[0][1], sender.sent[2][1]
    assert received["name"] == "batchfleet.batch.tiny"
    assert "'3 requests expired'" in received["args"] and "lanes {0: 1, 2: 2}" in received["args"]
    assert "['a', 'b', 'c']" in received["kwargs"]
    assert failed["exception"].startswith("deadline_exceeded")


def test_pause_and_resume_show_in_flower() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig())  # type: ignore[arg-type]
    obs.notify(StateChanged("tiny", "paused"))
    obs.notify(StateChanged("tiny", "running"))
    args = [f["args"] for t, f in sender.sent if t == "task-received"]
    assert args == ["('model tiny paused',)", "('model tiny running',)"]


def test_a_generating_step_that_admits_is_a_task_ending_with_the_running_batch() -> None:
    sender = FakeSender()
    obs = FlowerEvents(sender, "tiny", EventsConfig(max_batches_per_s=1e6))  # type: ignore[arg-type]
    items = (Waiting("0/1", 0, 0.0, tokens=30), Waiting("1/2", 1, 0.0, tokens=12, size=2))
    step = Batch(items, "step")
    dispatched(obs, step, "s1")
    received = sender.sent[0][1]
    assert (
        received["args"]
        == "('admit 2 requests', 3 sequences, lanes {0: 1, 1: 2}, 54 prompt tokens)"
    )
    assert "'sequences': 3" in received["kwargs"] and "'prompt_tokens': 54" in received["kwargs"]
    done(obs, step, "s1", 0.03, False, 0)
    assert len(sender.sent) == 2  # its result comes with the state after it
    obs.notify(Generated("tiny", running=40, waiting=5, kv_tokens=2500, kv_capacity=10000,
                         preempted=0, tokens=38))  # fmt: skip
    kind, fields = sender.sent[2]
    assert kind == "task-succeeded" and fields["uuid"] == "s1" and fields["runtime"] == 0.03
    assert fields["result"] == (
        "'2 requests admitted; then 40 sequences running, 5 requests waiting; "
        "38 tokens this step; KV cache 25%'"
    )
    # decode steps that admit nothing are no tasks; their state changes report nothing
    obs.notify(Dispatched("tiny", Batch((), "step"), "s2", (), 0.0))
    obs.notify(Generated("tiny", 40, 5, 2540, 10000, 0, tokens=40))
    assert len(sender.sent) == 3
