"""The generation chaos run's stored-stream check (``bench.gen_chaos_checks``), on token
streams laid out by hand: which layouts it passes, and what it says of the others (a
missing delta before the end, a stream a kill cut that shows no restart)."""

from __future__ import annotations

import pytest
import redis
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.results import Result, Timings

from bench.gen_chaos_checks import Report, check_stored_stream

KEYS = ModelKeys("chaos")

Layout = list[tuple[int, int, str | None]]
"""Entries as (life, seq, text; None: the end)."""


def stored(r: redis.Redis, rid: str, entries: Layout) -> None:
    for life, seq, text in entries:
        fields: dict[str, str | int] = {"life": life, "seq": seq}
        fields |= {"end": 1} if text is None else {"input": 0, "text": text, "tokens": 1}
        r.xadd(KEYS.tokens(rid), fields)  # type: ignore[arg-type]  # redis-py's loose typing
    r.expire(KEYS.tokens(rid), 60)


def answer(rid: str, text: str) -> Result:
    out = {"text": text, "finish_reason": "length", "completion_tokens": len(text)}
    return Result.model_construct(id=rid, model="chaos", status="ok", outputs=[out],
                                  metadata={}, timings=Timings(), finished_at_ms=1)  # fmt: skip


@pytest.mark.parametrize(
    ("entries", "cut", "runs", "bad"),
    [
        ([(1, 1, "a"), (1, 2, "b"), (1, 3, None)], False, 1, ""),
        ([(1, 1, "x"), (2, 1, "a"), (2, 2, "b"), (2, 3, None)], True, 2, ""),
        ([(1, 1, "x"), (2, 1, "a"), (2, 2, "b"), (2, 3, None)], False, 2, ""),
        # one attempt, though a kill cut it after its first delta
        ([(1, 1, "a"), (1, 2, "b"), (1, 3, None)], True, 1, "shows no restart: 1:1-2 1:3-3E"),
        # the one missing delta gen_chaos saw once: the end after a gap
        ([(1, 1, "a"), (1, 2, "b"), (1, 4, None)], False, 1, "end seq 4 after 2 deltas"),
    ],
    ids=["one-attempt", "cut-restarted", "restarted", "cut-no-restart", "end-after-gap"],
)
def test_a_stored_stream_is_checked_against_its_result(
    r: redis.Redis, entries: Layout, cut: bool, runs: int, bad: str
) -> None:
    stored(r, "g", entries)
    report = Report()
    assert check_stored_stream(r, KEYS, answer("g", "ab"), report, cut) == runs
    assert [v for v in report.violations if bad and bad in v] == report.violations
    assert bool(report.violations) == bool(bad), report.violations
