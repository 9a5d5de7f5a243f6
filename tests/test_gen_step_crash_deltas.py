"""A generating runner whose step raises once its engine ran (real Redis, the tiny Llama,
both engines, both scheduling modes; ``worker/runners/gen_state.py``'s ``Unsent``): its
requests' texts moved on in that step, and their deltas (and results) died with it, yet
every request that survives it streams all of its text — its deltas, numbered without a
gap, add up to its result, token ids and log-probabilities alike — a request the step
ended, before or after its result was built, is answered whole, and the tokens the step
generated are counted."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from batchfleet.producer import Producer
from batchfleet.producer.client import Job
from batchfleet.schemas.keys import GROUP
from batchfleet.schemas.results import Delta
from batchfleet.worker.generation.engine import Output
from batchfleet.worker.runner import StepEvent, StepReport
from batchfleet.worker.runners.gen_state import GenReq
from gen_checks import stream_entries
from gen_faults import (
    BREAK_AT,
    ENGINES,
    KEYS,
    MODEL,
    Breaking,
    Seen,
    make_loop,
    make_runner,
    run_loop,
)

pytestmark = pytest.mark.timeout(180)
NEW = 24
"""Tokens each long request generates."""


class LateCrash(Breaking):
    """The tiny Llama whose step ``crash_at`` raises once its engine ran: ``where`` is
    ``"rows"``: right after its rows were read into their texts (no event built yet);
    ``"deltas"``: in the output building of the request whose prompt holds ``target``,
    once its delta was built (and those of the requests read before it); ``"end"``: once
    every event of the step was built (deltas and results), before its report."""

    crash_at = BREAK_AT
    where = "rows"
    target = "target"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.raised = 0

    def _raise(self) -> None:
        self.raised += 1
        raise RuntimeError("runner bug once the engine ran")

    def _read_rows(
        self, outputs: list[Output], produced: dict[str, int]
    ) -> tuple[dict[str, GenReq], int]:
        read = super()._read_rows(outputs, produced)
        if self.where == "rows" and self.steps == self.crash_at:
            self._raise()
        return read

    def _reported(self, report: StepReport, events: list[StepEvent], prefilled: int) -> StepReport:
        if self.where == "end" and self.steps == self.crash_at:
            self._raise()
        return super()._reported(report, events, prefilled)

    def _deltas(self, r: GenReq, final: bool = False) -> Sequence[StepEvent]:
        out = super()._deltas(r, final)
        at = self.where == "deltas" and self.steps == self.crash_at and bool(out)
        if at and self.target in self.tokenizer.decode(r.spec.prompts[0]):
            self._raise()
        return out


def _submit(producer: Producer, text: str, new: int, *, stream: bool) -> Job:
    return producer.submit(MODEL, text, max_new_tokens=new, stream=stream, ignore_eos=True,
                           priority=0, return_token_ids=True, logprobs=1)  # fmt: skip


def _streamed_whole(r: redis.Redis, job: Job, tokens: int) -> None:
    """Answered ok with ``tokens`` tokens; its deltas (no restart among them), numbered
    1, 2, ..., add up to its result: text, tokens, token ids and log-probabilities."""
    res = job.result(timeout=1)
    assert res.ok and res.usage is not None and res.usage.completion_tokens == tokens
    assert res.outputs is not None
    out = res.outputs[0]
    stream_entries(r, job)
    deltas = list(job.deltas(timeout=5))
    assert all(isinstance(d, Delta) for d in deltas)
    ds = [d for d in deltas if isinstance(d, Delta)]
    assert "".join(d.text for d in ds) == out["text"]
    assert sum(d.tokens for d in ds) == tokens == len(out["token_ids"])
    assert all(d.token_ids is not None and len(d.token_ids) == d.tokens for d in ds)
    assert [t for d in ds for t in d.token_ids or []] == out["token_ids"]
    assert all(d.logprobs is not None and len(d.logprobs) == d.tokens for d in ds)
    assert [lp.token for d in ds for lp in d.logprobs or []] == [
        lp["token"] for lp in out["logprobs"]
    ]


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "in-turn"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("where", ["rows", "deltas", "end"])
def test_requests_surviving_a_step_that_raised_once_run_stream_their_whole_text(
    r: redis.Redis, tiny_lm: Path, ahead: bool, engine: str, where: str
) -> None:
    # Given three streaming generations (token ids and log-probabilities asked), one that
    # does not stream, and ("rows", "end") a streaming one and one that does not stream
    # that end in the third step; and a runner whose third step raises once its engine ran:
    # after reading its rows (their ends not built), ("deltas") while building the outputs,
    # once the middle stream's delta is built, or ("end") once all its events are built
    producer = Producer(client=r)
    streams = [_submit(producer, f"the dog {name}", NEW, stream=True)
               for name in ("one", "target", "three")]  # fmt: skip
    quiet = _submit(producer, "the fox", NEW, stream=False)
    ends = where != "deltas"
    short = _submit(producer, "the cat", BREAK_AT, stream=True) if ends else None
    short_quiet = _submit(producer, "the bird", BREAK_AT, stream=False) if ends else None
    runner = make_runner(tiny_lm, ahead=ahead, engine=engine, break_at=0, kind=LateCrash)
    runner.where = where
    seen = Seen()
    # When a burst loop serves them
    run_loop(make_loop(r, runner, "w1", burst=True, seen=seen))
    # Then the step raised once, and every request was answered whole: the streaming ones'
    # deltas hold all their text, tokens and extras, no delta lost with the step
    assert runner.raised == 1
    for job in streams:
        _streamed_whole(r, job, NEW)
    res = quiet.result(timeout=1)
    assert res.ok and res.usage is not None and res.usage.completion_tokens == NEW
    if short is not None:  # ended in the step that raised: its end built in it, or after
        _streamed_whole(r, short, BREAK_AT)
    if short_quiet is not None:
        res = short_quiet.result(timeout=1)
        assert res.ok and res.usage is not None and res.usage.completion_tokens == BREAK_AT
        assert res.outputs is not None and len(res.outputs[0]["token_ids"]) == BREAK_AT
    # ...and the tokens generated were all counted, the crashed step's with the next one
    total = NEW * 4 + 2 * BREAK_AT * ends
    assert seen.tokens == total and runner.produced == total
    assert r.xpending(KEYS.lane(0), GROUP)["pending"] == 0
