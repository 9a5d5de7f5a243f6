"""A generating loop in virtual time (the scripted runner of ``test_generation_loop``)
answers a request whose sequences can never fit the KV cache together ``invalid_request``,
saying why, as docs/protocol.md promises (not ``expired``): stored as this attempt's, its
token stream ended; what comes behind it runs."""

from __future__ import annotations

import pytest
from batchfleet.schemas.messages import Request
from test_generation_loop import Tokens, gen_rig, outputs
from virtual_world import MODEL


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "ahead"])
def test_sequences_never_fitting_together_are_refused_as_invalid_request(ahead: bool) -> None:
    # Given a KV cache of 4 blocks of 16 tokens, and a request of five sequences of a
    # short prompt (a block each: five together, though each alone would fit; the
    # scripted runner runs a sequence per input, as the policy counts ``n`` completions)
    runner = Tokens(kv_cache_tokens=64, page_size=16, max_running=8, schedule_ahead=ahead)
    r, _ = gen_rig(runner)
    r.source.add(Request(id="wide", model=MODEL, inputs=["a b c"] * 5, max_new_tokens=5,
                         stream=True), lane=1)  # fmt: skip
    r.source.add(Request(id="ok", model=MODEL, inputs=["a b c"] * 2, max_new_tokens=5), lane=1)
    # When the loop runs
    r.run()
    # Then it is answered once, an invalid request saying what it needs, never computed
    res = r.result("wide")
    assert res.status == "error" and res.error is not None, res
    assert res.error.code == "invalid_request", res.error
    assert res.error.message.startswith("this request can never start on this worker: ")
    assert "its 5 sequences together need 5 KV cache blocks" in res.error.message
    assert res.timings.batch_size == 0
    assert len([k for w in runner.steps for k, _ in w.admit]) == 1  # "ok" alone ran
    (end,) = r.sink.streamed["wide"]  # its token stream ends, though nothing streamed
    assert end.delta is None and end.seq == 1
    sent = {a.result.id: a for batch in r.sink.sent for a in batch}
    assert sent["wide"].fenced and sent["wide"].end is not None
    # And the request behind it runs as usual
    assert outputs(r, "ok")["completion_tokens"] == 5
