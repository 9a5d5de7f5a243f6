"""Failure isolation inside one step of a one-shot runner: bisection and OOM splitting."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from batchfleet.schemas.messages import Request
from batchfleet.worker.runner import BatchRunner, Encoded, Failed, Final, Prepared, Work


def _row(token: int, n: int = 3) -> Encoded:
    return Encoded(ids=(token,) * n, type_ids=(0,) * n, truncated=False)


def _work(*groups: Sequence[Encoded]) -> Work:
    admit = tuple(
        (f"k{i}", Prepared(list(g), len(g), max(r.tokens for r in g))) for i, g in enumerate(groups)
    )
    return Work("step", admit)


def _outputs(report: Any) -> list[Any]:
    return [e.outputs if isinstance(e, Final) else e for e in report.events]


class Picky(BatchRunner):
    """Echoes each row's first id; raises on a poison id, or OOM above ``max_rows`` rows.
    (A stand-in for a GPU model: CUDA OOM cannot be provoked on this CPU machine.)"""

    name = "picky"

    def __init__(self, poison: int | None = None, max_rows: int | None = None) -> None:
        self.poison = poison
        self.max_rows = max_rows
        self.calls: list[int] = []

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        if any(t == "bad" for t in texts):
            raise ValueError("cannot encode 'bad'")
        return [_row(len(t)) for t in texts]

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        self.calls.append(len(rows))
        if self.max_rows is not None and len(rows) > self.max_rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if any(r.ids[0] == self.poison for r in rows):
            raise ValueError("poison")
        return [r.ids[0] for r in rows]


def test_clean_batch_runs_once() -> None:
    h = Picky()
    report = h.step(_work([_row(1)], [_row(2), _row(3)]))
    assert _outputs(report) == [[1], [2, 3]]
    assert h.calls == [3] and not report.out_of_memory and report.calls == 1


def test_poison_request_is_isolated_by_bisection() -> None:
    h = Picky(poison=5)
    report = h.step(_work(*[[_row(i)] for i in range(8)]))
    events = report.events
    assert isinstance(events[5], Failed) and "poison" in events[5].message
    assert events[5].key == "k5"
    assert [e.outputs for i, e in enumerate(events) if i != 5] == [[i] for i in range(8) if i != 5]
    assert not report.out_of_memory
    assert len(h.calls) <= 1 + 2 * 3  # log2(8) levels of halves
    assert report.calls == len(h.calls) > 1


def test_out_of_memory_splits_down_to_what_fits() -> None:
    h = Picky(max_rows=2)
    report = h.step(_work(*[[_row(i)] for i in range(6)], [_row(7), _row(8), _row(9)]))
    assert _outputs(report) == [[i] for i in range(6)] + [[7, 8, 9]]
    assert report.out_of_memory
    assert max(n for n in h.calls if n <= 2) <= 2


def test_out_of_memory_on_one_row_fails_only_that_request() -> None:
    h = Picky(max_rows=0)
    report = h.step(_work([_row(1)], [_row(2)]))
    assert all(isinstance(e, Failed) and "out of memory" in e.message for e in report.events)
    assert report.out_of_memory


def test_wrong_output_count_is_a_failure() -> None:
    class Short(Picky):
        def run(self, rows: Sequence[Encoded]) -> list[Any]:
            return [0] * (len(rows) + 1)

    report = Short().step(_work([_row(1)], [_row(2)]))
    assert all(isinstance(e, Failed) and "2 outputs for 1 rows" in e.message for e in report.events)


def test_prepare_many_isolates_an_input_the_tokenizer_rejects() -> None:
    h = Picky()
    reqs = [Request(id=i, model="m", inputs=[t]) for i, t in (("a", "ok"), ("b", "bad"))]
    good, bad = h.prepare_many(reqs)
    assert isinstance(good, Prepared) and good.rows == 1
    assert isinstance(bad, Exception) and "cannot tokenize" in str(bad)


class Activations:
    """Stands for a failed call's tensors: alive while its frame is."""


class Hoarder(Picky):
    """Runs out of memory above ``max_rows`` with an activation alive in its frame, and
    records, at each call, whether the last failed call's activation is still alive."""

    def __init__(self, max_rows: int) -> None:
        super().__init__(max_rows=max_rows)
        self.last: weakref.ref[Activations] | None = None
        self.alive_at_call: list[bool] = []

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        self.alive_at_call.append(self.last is not None and self.last() is not None)
        activations = Activations()
        self.last = weakref.ref(activations)
        return super().run(rows)


def test_a_split_retries_after_the_failed_call_has_freed_its_memory() -> None:
    # Given a batch that runs out of memory, its activations held in the failed frame
    h = Hoarder(max_rows=1)
    report = h.step(_work([_row(1), _row(2), _row(3), _row(4)]))
    # Then every retry runs with the failed call's memory freed (not from inside the
    # except clause, whose traceback keeps the failed call's frames alive)
    assert _outputs(report) == [[1, 2, 3, 4]] and report.out_of_memory
    assert h.calls == [4, 2, 1, 1, 2, 1, 1]
    assert not any(h.alive_at_call)
