"""A generating loop whose step hand-off fails while writing the step's deltas (real
Redis, the tiny Llama, both engines, both scheduling modes): no reader of a token stream
ever sees a gap in its ``seq`` (docs/protocol.md: a late reader misses nothing). The
deltas a failed write left are written again before the stream's end; where they fail
again they are left out, and the end follows the last delta written."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.keys import GROUP
from batchfleet.worker.sink import RedisSink
from batchfleet.worker.streamed import Streamed
from gen_checks import failed_with, stream_entries, whole
from gen_faults import ENGINES, KEYS, Seen, make_loop, make_runner, run_loop, submit

pytestmark = pytest.mark.timeout(180)

BREAK_CALL = 3
"""The sink's delta write that fails: the third step's (every request streamed by then)."""

Attempt = list[tuple[str, int, str | None]]
"""One delta write: (request id, ``seq``, text) of each delta."""


class FailingWrites:
    """``RedisSink.stream_now`` that raises on its calls ``BREAK_CALL`` to
    ``BREAK_CALL + times - 1``, before sending anything; every call's deltas noted."""

    def __init__(self, write: Callable[[RedisSink, Sequence[Streamed]], None], times: int):
        self.write = write
        self.times = times
        self.attempts: list[tuple[Attempt, bool]] = []
        """Each call's deltas, and whether they were written."""

    def __call__(self, sink: RedisSink, items: Sequence[Streamed]) -> None:
        noted = [(it.request_id, it.seq, it.text) for it in items]
        fails = BREAK_CALL <= len(self.attempts) + 1 < BREAK_CALL + self.times
        self.attempts.append((noted, not fails))
        if fails:
            raise RuntimeError("sink down")
        self.write(sink, items)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "in-turn"])
@pytest.mark.parametrize("times", [1, 2], ids=["retried", "failed-again"])
def test_deltas_whose_write_failed_are_written_before_the_end_or_left_out_without_a_gap(
    r: redis.Redis, tiny_lm: Path, monkeypatch: pytest.MonkeyPatch, engine: str, ahead: bool,
    times: int,
) -> None:  # fmt: skip
    # Given two streaming generations and two that do not stream, and a sink whose third
    # delta write raises (``times`` 2: and the write after it, the retry)
    writes = FailingWrites(RedisSink.stream_now, times)
    monkeypatch.setattr(RedisSink, "stream_now", lambda sink, items: writes(sink, items))
    producer = Producer(client=r)
    streams = [submit(producer, f"the dog {k}", 40, stream=True) for k in range(2)]
    quiet = [submit(producer, f"the fox {k}", 12, stream=False) for k in range(2)]
    runner, seen = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=0), Seen()
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True, seen=seen))
    # Then the step's hand-off failed: its streaming requests failed with it...
    for job in streams:
        failed_with(job, "finishing the step failed: RuntimeError: sink down")
    # ...each token stream numbered 1, 2, ... with no gap, to its end...
    streamed = {job.id: stream_entries(r, job) for job in streams}
    # ...the failed write tried again with the same deltas, numbered the same, before it;
    # the deltas written are the stream's: the failed step's among them where the retry
    # wrote them
    (failed, ok), (again, ok_again) = writes.attempts[BREAK_CALL - 1 : BREAK_CALL + 1]
    assert not ok and again == failed and ok_again == (times == 1)
    assert {rid for rid, _, _ in failed} == {job.id for job in streams}
    written = [delta for deltas, ok in writes.attempts if ok for delta in deltas]
    for rid, (*deltas, _) in streamed.items():
        assert [(int(f[b"seq"]), f[b"text"].decode()) for f in deltas] == [
            (seq, text) for written_id, seq, text in written if written_id == rid
        ]
        assert len(deltas) == BREAK_CALL - (times - 1)
    # ...while the others got all their tokens; nothing is pending, and the engine ran
    # nothing the loop had failed once its stop was in (its count the scheduler's)
    for job in quiet:
        whole(job, 12)
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0
    stop_at = next(i for i, h in enumerate(runner.held) if h.stops)
    assert all(not (h.keys & runner.streaming) for h in runner.held[stop_at:])
    assert all(seen.after[h.step_id] == (h.sequences, h.kv_tokens) for h in runner.held[stop_at:])
    assert seen.tokens == runner.produced
