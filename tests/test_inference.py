"""Failure isolation inside one micro-batch: bisection and out-of-memory splitting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from batchfleet.worker.handlers.base import Encoded
from batchfleet.worker.inference import Failure, run_batch


def _row(token: int, n: int = 3) -> Encoded:
    return Encoded(ids=(token,) * n, type_ids=(0,) * n, truncated=False)


class Picky:
    """Echoes each row's first id; raises on a poison id, or OOM above ``max_rows`` rows.
    (A stand-in for a GPU model: CUDA OOM cannot be provoked on this CPU machine.)"""

    name = "picky"
    device = "cpu"

    def __init__(self, poison: int | None = None, max_rows: int | None = None) -> None:
        self.poison = poison
        self.max_rows = max_rows
        self.calls: list[int] = []

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        raise NotImplementedError

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        self.calls.append(len(rows))
        if self.max_rows is not None and len(rows) > self.max_rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if any(r.ids[0] == self.poison for r in rows):
            raise ValueError("poison")
        return [r.ids[0] for r in rows]

    def info(self) -> dict[str, Any]:
        return {}


def test_clean_batch_runs_once() -> None:
    h = Picky()
    out = run_batch(h, [[_row(1)], [_row(2), _row(3)]])
    assert out.outcomes == [[1], [2, 3]]
    assert h.calls == [3] and not out.out_of_memory


def test_poison_request_is_isolated_by_bisection() -> None:
    h = Picky(poison=5)
    groups = [[_row(i)] for i in range(8)]
    out = run_batch(h, groups)
    assert isinstance(out.outcomes[5], Failure) and "poison" in out.outcomes[5].message
    assert [o for i, o in enumerate(out.outcomes) if i != 5] == [[i] for i in range(8) if i != 5]
    assert not out.out_of_memory
    assert len(h.calls) <= 1 + 2 * 3  # log2(8) levels of halves


def test_out_of_memory_splits_until_it_fits() -> None:
    h = Picky(max_rows=2)
    out = run_batch(h, [[_row(i)] for i in range(8)])
    assert out.outcomes == [[i] for i in range(8)]
    assert out.out_of_memory
    assert max(c for c in h.calls[1:]) <= 4


def test_out_of_memory_splits_one_large_request() -> None:
    h = Picky(max_rows=2)
    out = run_batch(h, [[_row(i) for i in range(6)]])
    assert out.outcomes == [[0, 1, 2, 3, 4, 5]]
    assert out.out_of_memory


def test_host_memory_error_counts_as_oom() -> None:
    class Host(Picky):
        def run(self, rows: Sequence[Encoded]) -> list[Any]:
            if len(rows) > 1:
                raise MemoryError()
            return [r.ids[0] for r in rows]

    out = run_batch(Host(), [[_row(1)], [_row(2)]])
    assert out.outcomes == [[1], [2]] and out.out_of_memory


def test_wrong_output_count_is_a_failure() -> None:
    class Short(Picky):
        def run(self, rows: Sequence[Encoded]) -> list[Any]:
            return []

    out = run_batch(Short(), [[_row(1)]])
    assert isinstance(out.outcomes[0], Failure)
