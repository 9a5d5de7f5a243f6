"""The policy's views the generating scheduler builds each plan (``worker/gen_states.py``,
``batching/gen_types.running``): equal to the plain dataclasses, remade only when what
they show changed."""

from __future__ import annotations

from dataclasses import fields

from batchfleet.batching.gen_types import GenRunning, GenWaiting, running
from batchfleet.batching.types import Waiting
from batchfleet.schemas.messages import Request
from batchfleet.worker.answers import Held
from batchfleet.worker.gen_states import Resume, Running, WaitingViews, running_view
from batchfleet.worker.runner import Prepared, progress
from batchfleet.worker.streams import Entry


def held(key: str, lane: int = 1, prompt: int = 8, new: int = 10) -> Held:
    prep = Prepared(None, rows=1, tokens=prompt, prompts=(prompt,), max_new_tokens=new)
    req = Request(id=key, model="m", inputs=["x"], max_new_tokens=new)
    return Held(Entry(lane, key, {}), req, "msgpack", prep,
                Waiting(key, lane, 0.5, prompt, deadline=9.0), 0.5)  # fmt: skip


def test_running_builds_the_same_value_as_the_dataclass() -> None:
    args = ("k", 2, 0.5, 9.0, 1.5, (30, 31), (0, 4), 7, 3, (0, 1))
    fast, plain = running(*args), GenRunning(*args)
    assert fast == plain and hash(fast) == hash(plain)
    assert [getattr(fast, f.name) for f in fields(GenRunning)] == list(args)


def test_running_view_projects_a_decoding_request_one_step_ahead() -> None:
    r = Running(held("a"), 1.0, progress((12,), (0,), 5), preempted=2)
    assert running_view("a", r, 1) == GenRunning("a", 1, 0.5, 9.0, 1.0, (13,), (0,), 4, 2)
    assert running_view("a", r, 0) == GenRunning("a", 1, 0.5, 9.0, 1.0, (12,), (0,), 5, 2)
    prefilling = Running(held("b"), 1.0, progress((4,), (4,), 10))
    assert running_view("b", prefilling, 1).contexts == (4,)  # type: ignore[union-attr]
    last = Running(held("c"), 1.0, progress((12,), (0,), 1))
    assert running_view("c", last, 1) is None  # its last token is in flight


def test_waiting_views_are_kept_until_their_request_changes() -> None:
    # Given two waiting requests, viewed once
    views = WaitingViews()
    a, b = held("a"), held("b", lane=2)
    waiting = {"a": a, "b": b}
    first = views.of_all(waiting, {}, set())
    assert first == [GenWaiting("a", 1, 0.5, 9.0, (8,), 10), GenWaiting("b", 2, 0.5, 9.0, (8,), 10)]
    # When nothing changed: the same views; a key skipped is left out
    again = views.of_all(waiting, {}, set())
    assert all(x is y for x, y in zip(first, again, strict=True))
    assert [w.key for w in views.of_all(waiting, {}, {"a"})] == ["b"]
    # When one was preempted (its state to resume from): its view is remade from that
    res = Resume((20,), 4, 1.0, 1.2, 3, 0.9)
    third = views.of_all(waiting, {"b": res}, set())
    assert third[0] is first[0] and third[1] == GenWaiting("b", 2, 0.5, 9.0, (20,), 4)
    # And a request read again under its key (a new Held) is viewed anew
    a2 = held("a", prompt=16)
    assert views.of_all({"a": a2}, {}, set())[0].prompts == (16,)
