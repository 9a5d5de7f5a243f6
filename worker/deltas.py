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
next step, and the answer is read by the sink's writer thread, woken for it (else by the
next step's write), before it writes anything the loop handed it, so a stream's end or
result never overtakes its deltas, and deltas whose write failed are written again first.
Reading it here, before the next step, the device idled about 0.5 ms a step (saturated,
tiny model: the call's run in Redis, which shares the cores with the loop thread).

The loop tells it, before it submits a step, where the requests that step admits stream
to (:meth:`DeltaWriter.expect`); the rest is its own: which requests stream, and their
last ``seq``, until they end (a result or a failure). A request preempted whole stays
its own too: stopped while parked (a deadline, a cancel), its runner ends it with its
last delta and its result in a step that admits nothing, and that delta is streamed in
turn; resumed, the loop expects it again. The loop counts the same ``Partial`` events,
so it knows each request's last ``seq`` for its stream's end entry and for a resumed
request.
"""

from __future__ import annotations

import logging
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
from .runner import Failed, Final, Partial, Preempted, StepEvent, StepReport
from .streamed import Streamed, plain_delta

logger = logging.getLogger(__name__)

_PLAIN = frozenset(("input", "text", "tokens"))
"""A delta's chunk with nothing but its text and counts (most of them)."""


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
        if len(chunk) == 3 and chunk.keys() == _PLAIN:  # most deltas: see Streamed.item
            return plain_delta(self.request_id, seq, chunk["text"], self.ttl_s, self.reply,
                               self.fmt, chunk["input"], chunk["tokens"], self.model,
                               self.life)  # fmt: skip
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
        """Device thread: the streaming requests on the device, or parked in its runner..."""
        self._seq: dict[str, int] = {}
        """...and the last ``seq`` each was sent."""
        self._posted: str | None = None
        """The last step posted: one posted again (its hand-off failed, the executor posts
        it with its unfinished requests failed) streamed its deltas already..."""
        self._unwritten = False
        """...unless writing them failed: then they are written with it (retried before
        the loop ends their streams), or, failing again, left out (:meth:`_unstreamed`)."""

    def expect(self, targets: Sequence[StreamTo]) -> None:
        """Requests a step about to be submitted admits (call before submitting it)."""
        if targets:
            self._expected.put(targets)

    def post(self, done: StepDone | DeviceStopped) -> None:
        """A step ended: stream its deltas, then hand it to the loop."""
        if isinstance(done, DeviceStopped):
            self._then(done)
            return
        while True:
            try:
                targets = self._expected.get_nowait()
            except queue.Empty:
                break
            for target in targets:
                self._to[target.key] = target
                self._seq[target.key] = target.seq
        events = done.report.events
        if done.step_id != self._posted:
            self._posted, self._unwritten = done.step_id, True
            self._write(events)  # raising: the executor posts the step again
            self._unwritten = False
        elif self._unwritten:  # posted again, its deltas not handed over the first time
            self._unwritten = False
            try:
                self._write(events)  # before the loop has the step, and ends the streams
            except Exception as exc:
                logger.exception("writing the deltas of step %s failed again: left out",
                                 done.step_id)  # fmt: skip
                self._unstreamed(done.report, f"writing its deltas failed: {exc!r}")
        else:  # written the first time (the loop counts them once)
            self._forget_ended(events)
        done.report.settle()  # the runner's work left for after the deltas
        self._then(done)

    def _write(self, events: Sequence[StepEvent]) -> None:
        """Number and send the deltas of a step's events, then forget the requests it
        ended; all or nothing: a failure leaves each request's ``seq`` where it was."""
        to, seqs = self._to, self._seq
        out: list[Streamed] = []
        ended = False
        try:
            for ev in events:
                t = to.get(ev.key)
                if t is None:
                    continue
                if isinstance(ev, Partial):
                    seq = seqs[ev.key] + 1
                    out.append(t.delta(seq, ev.chunk))
                    seqs[ev.key] = seq
                elif _ends(ev):
                    ended = True
            # sent before the step's end reaches the loop, which ends streams (the sink
            # reads Redis's answer to this before it writes anything the loop hands it)
            if out:
                if self._suspect():
                    for it in out:
                        it.life = -it.life
                self._stream(out)
        except BaseException:
            numbered = len(out)  # numbered, not sent: numbered again when retried
            for ev in events:
                if numbered and isinstance(ev, Partial) and ev.key in to:
                    seqs[ev.key] -= 1
                    numbered -= 1
            raise
        if ended:
            self._forget_ended(events)

    def _forget_ended(self, events: Sequence[StepEvent]) -> None:
        """The requests these events end stream no more (not those parked: see the
        module's docstring)."""
        for ev in events:
            if _ends(ev) and ev.key in self._to:
                del self._to[ev.key], self._seq[ev.key]

    def _unstreamed(self, report: StepReport, message: str) -> None:
        """A step whose deltas could not be written: its streaming requests' deltas are
        left out of the events the loop gets, which numbers each stream's end right after
        the deltas written (no reader sees a gap); those the step ended or parked fail,
        their deltas short of their text (a parked one abandoned, for the loop to stop)."""
        events = report.events
        lost = {ev.key for ev in events if isinstance(ev, Partial) and ev.key in self._to}
        kept: list[StepEvent] = []
        parked: list[str] = []
        for ev in events:
            if ev.key not in lost:
                kept.append(ev)
            elif isinstance(ev, Final) or (isinstance(ev, Preempted) and not ev.alone):
                kept.append(Failed(ev.key, message))
                if isinstance(ev, Preempted):
                    parked.append(ev.key)
            elif not isinstance(ev, Partial):
                kept.append(ev)
        self._forget_ended(kept)  # (a parked one failed too)
        report.events = kept
        report.abandoned = (*report.abandoned, *parked)


def _ends(ev: StepEvent) -> bool:
    """The event ends its request's stream: its result or its failure (a request parked
    whole still streams the last delta it ends with, stopped while parked)."""
    return isinstance(ev, Final | Failed)
