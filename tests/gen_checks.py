"""What the requests of a faulted generation loop got (:mod:`gen_faults`' tests): a
failed one's error, a whole one's tokens and text, a token stream numbered to its end."""

from __future__ import annotations

import redis
from batchfleet.producer.client import Job
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.results import Delta
from gen_faults import KEYS


def stream_entries(r: redis.Redis, job: Job) -> list[dict[bytes, bytes]]:
    """A request's token stream's entries, checked numbered 1, 2, ... with one end, last."""
    entries = [fields for _, fields in r.xrange(KEYS.tokens(job.id))]
    assert [int(f[b"seq"]) for f in entries] == list(range(1, len(entries) + 1))
    assert [f.get(b"end") for f in entries].count(b"1") == 1 and entries[-1][b"end"] == b"1"
    return entries


def whole(job: Job, tokens: int, *, stream: bool = False) -> None:
    """The request was answered ok, all its tokens generated; streaming, its deltas hold
    its whole text."""
    res = job.result(timeout=1)
    assert res.ok and res.usage is not None and res.usage.completion_tokens == tokens
    if stream:
        assert res.outputs is not None
        deltas = [d for d in job.deltas(timeout=5) if isinstance(d, Delta)]
        assert "".join(d.text for d in deltas) == res.outputs[0]["text"]
        assert sum(d.tokens for d in deltas) == tokens


def failed_with(job: Job, message: str) -> None:
    """The request failed with the step: ``inference_failed``, ``message`` in its error."""
    res = job.result(timeout=1)
    assert res.status == "error" and res.error is not None
    assert res.error.code is ErrorCode.INFERENCE_FAILED and message in res.error.message
