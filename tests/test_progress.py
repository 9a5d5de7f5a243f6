"""``runner.progress``: the fast ``Progress`` a generating runner makes per request and step."""

from __future__ import annotations

import dataclasses

import pytest
from batchfleet.worker.runner import DONE, Progress, progress


@pytest.mark.parametrize(
    "args",
    [((7,), (3,), 5, ()), ((1, 2), (0, 9), 4, (0, 2)), ((), (), 0, ())],
)
def test_progress_equals_the_dataclass_it_builds(args: tuple) -> None:
    made, expected = progress(*args), Progress(*args)
    assert type(made) is Progress
    assert made == expected and hash(made) == hash(expected)
    assert dataclasses.astuple(made) == args


def test_progress_without_seqs_names_none_and_stays_frozen() -> None:
    made = progress((4,), (0,), 2)
    assert made.seqs == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.contexts = (5,)  # type: ignore[misc]


def test_done_is_a_request_whose_sequences_all_ended() -> None:
    assert Progress((), (), 0) == DONE
