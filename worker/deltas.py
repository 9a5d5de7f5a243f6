"""A generating model's deltas leave from its device thread, as soon as its step ends.

The step's tokens are streamed the moment its runner reports them: this numbers each
request's deltas and writes them (``ResultSink.stream_now``: on this thread, at once,
unless a token write already waits for the sink's writer thread), then passes the step
on to the loop. Routed through the loop, a delta waited for the loop thread to wake and
take the step in (saturated: 1.5 of its 3.7 ms from token to subscriber); handed to the
writer thread, it waited for that thread to get the GIL and for Redis, beside the next
step (saturated, fresh workers alternating, ``tokens.lua`` encoding the messages: 2.6
against 3.6 ms p50 when written here, at the same tokens/s). It sends the write and hands
the step to the loop without waiting for Redis's answer: the device thread goes on to the
next step, and the answer is read by the next step's write or by the sink's writer thread
before it writes anything the loop handed it, whichever comes first, so a stream's end or
result never overtakes its deltas, and deltas whose write failed are written again first.
Reading it here, before the next step, the device idled about 0.5 ms a step (saturated,
tiny model: the call's run in Redis, which shares the cores with the loop thread).

The loop tells it, before it submits a step, where the requests that step admits stream
to (:meth:`DeltaWriter.expect`); the rest is its own: which requests stream, and their
last ``seq``. The loop counts the same ``Partial`` events, so it knows each request's
last ``seq`` for its stream's end entry and for a resumed request.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..schemas.codec import (
    logprobs_json,
    prompt_logprobs_json,
    token_ids_json,
    tool_calls_json,
    tool_chunks_json,
)
from ..schemas.messages import Format
from .inbox import DeviceStopped, StepDone
from .runner import Failed, Final, Partial, Preempted
from .streamed import Streamed


@dataclass(frozen=True, slots=True)
class StreamTo:
    """Where one streaming request's deltas go, and the ``seq`` it has reached."""

    key: str
    """The scheduler's key of the request (the runner's events name it)."""
    request_id: str
    model: str
    ttl_s: int
    reply: str | None
    fmt: Format
    seq: int = 0
    life: int = 0
    """Which attempt at the request this is (its entry's delivery count): the token stream
    refuses an earlier attempt's entries once a later one has written (``tokens.lua``, for
    the entries it is asked to check: a stream's end always, deltas when the worker may
    have been taken for dead, see :class:`DeltaWriter`)."""

    def delta(self, seq: int, chunk: Any) -> Streamed:
        """Delta number ``seq`` (``chunk``: the runner's ``{"input", "text", "tokens"}``), or
        the token stream's end (``chunk`` None)."""
        if not isinstance(chunk, dict):  # an end is always checked: a negative life
            return Streamed(
                self.request_id, seq, None, self.ttl_s, self.reply, self.fmt, life=-self.life
            )
        lps = chunk.get("logprobs")
        calls = chunk.get("tool_calls")
        ids = chunk.get("token_ids")
        pieces = chunk.get("tool_call_chunks")
        scored = chunk.get("prompt_logprobs")
        prompt_ids = chunk.get("prompt_token_ids")
        return Streamed(self.request_id, seq, chunk.get("text", ""), self.ttl_s, self.reply,
                        self.fmt, chunk.get("input", 0), chunk.get("tokens", 0), self.model,
                        None if lps is None else logprobs_json(lps), self.life,
                        None if calls is None else tool_calls_json(calls),
                        chunk.get("content"), chunk.get("reasoning_content"),
                        None if ids is None else token_ids_json(ids),
                        None if pieces is None else tool_chunks_json(pieces),
                        chunk.get("prompt_tokens"), chunk.get("prompt_text"),
                        None if scored is None else prompt_logprobs_json(scored),
                        None if prompt_ids is None else token_ids_json(prompt_ids))  # fmt: skip


class DeltaWriter:
    """Streams each finished step's deltas, then posts the step (``then``) to the loop,
    without waiting for Redis's answer (see the module's docstring).
    ``post`` runs on the device thread; ``expect`` on the loop thread."""

    def __init__(
        self,
        stream: Callable[[Sequence[Streamed]], None],
        then: Callable[[StepDone | DeviceStopped], None],
        suspect: Callable[[], bool] = lambda: False,
    ) -> None:
        self._stream = stream
        self._then = then
        self._suspect = suspect
        """Whether this worker may have been taken for dead lately (the intake's
        :meth:`~.intake.Intake.suspect`): its deltas are then written checked against a
        later attempt's (``tokens.lua``); otherwise unchecked, at no cost."""
        self._expected: queue.SimpleQueue[Sequence[StreamTo]] = queue.SimpleQueue()
        self._to: dict[str, StreamTo] = {}
        """Device thread: the streaming requests on the device..."""
        self._seq: dict[str, int] = {}
        """...and the last ``seq`` each was sent."""
        self._posted: str | None = None
        """The last step posted: one posted again (its hand-off failed, the executor posts
        it with its unfinished requests failed) streamed its deltas already."""

    def expect(self, targets: Sequence[StreamTo]) -> None:
        """Requests a step about to be submitted admits (call before submitting it)."""
        if targets:
            self._expected.put(targets)

    def post(self, done: StepDone | DeviceStopped) -> None:
        """A step ended: stream its deltas, then hand it to the loop."""
        if isinstance(done, DeviceStopped):
            self._then(done)
            return
        to = self._to
        while True:
            try:
                targets = self._expected.get_nowait()
            except queue.Empty:
                break
            for target in targets:
                to[target.key] = target
                self._seq[target.key] = target.seq
        again = done.step_id == self._posted
        self._posted = done.step_id
        out: list[Streamed] = []
        for ev in done.report.events:
            t = to.get(ev.key)
            if t is None:
                continue
            if isinstance(ev, Partial):
                if again:  # numbered and sent the first time (the loop counts it once)
                    continue
                seq = self._seq[ev.key] + 1
                self._seq[ev.key] = seq
                out.append(t.delta(seq, ev.chunk))
            elif isinstance(ev, Final | Failed | Preempted):  # a resumed one is expected again
                del to[ev.key], self._seq[ev.key]
        # sent before the step's end reaches the loop, which ends streams (the sink reads
        # Redis's answer to this before it writes anything the loop hands it)
        if out:
            if self._suspect():
                for it in out:
                    it.life = -it.life
            self._stream(out)
        done.report.settle()  # the runner's work left for after the deltas
        self._then(done)
