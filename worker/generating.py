"""What the loop does for a generating runner's requests: answer each step, end the
token streams, carry out cancellations, keep the cancel watcher's list current.

Kept apart from ``loop.py``, which owns the loop thread and everything common to both
kinds of runner; this is called from that thread only, and holds no request state of its own —
the request state is the :class:`~.gen_scheduler.GenScheduler`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..config import ModelConfig
from ..schemas.errors import ErrorCode
from .answers import Answerer, BatchRun, Held, Outgoing
from .deltas import StreamTo
from .gen_scheduler import GenScheduler
from .gen_states import Running
from .inbox import StepDone
from .observers import BatchDone, Generated, Observers
from .parts import Parts
from .runner import Failed, Final, Partial, Preempted, StepReport
from .scheduler import Step
from .streamed import Streamed


class Generating:
    """The generation side of one model's loop (``scheduler`` None: not a generator)."""

    def __init__(
        self,
        model: str,
        config: ModelConfig,
        scheduler: GenScheduler | None,
        answers: Answerer,
        observers: Observers,
        parts: Parts,
        clock: Callable[[], float],
    ) -> None:
        self.model = model
        self.config = config
        self.scheduler = scheduler
        self.answers = answers
        self.observers = observers
        self.parts = parts
        self._clock = clock
        self._watched = -1
        """The scheduler's ``version`` the cancel watcher was last told of."""

    def finished(self, done: StepDone, next_step: Callable[[], object] | None = None) -> None:
        """A step ended (its deltas were streamed from the device thread, see
        ``deltas.py``): answer the requests that ended. ``next_step`` (dispatching the next
        step) runs before the answers are built, so the device waits only for the
        scheduler's update."""
        assert self.scheduler is not None
        report = done.report
        step, named = self.scheduler.finished(
            done.step_id, report, done.started_at, done.finished_at
        )
        gaps = self._timing(report, named, done.finished_at)
        sink = self.parts.sink
        if next_step is not None:
            next_step()
        now = self._clock()
        out: list[Outgoing] = []
        failed = 0
        for ev in done.report.events:
            if isinstance(ev, Partial):
                continue  # (most events: a token, streamed already)
            r = named.get(ev.key)
            if r is None or r.lost:
                continue  # (lost: another worker took it over and answers it)
            held = r.held
            run = BatchRun(step.step_id, len(named), r.started_at, done.finished_at)
            if isinstance(ev, Final) and len(ev.outputs) != held.request.output_count:
                failed += 1
                message = (
                    f"runner returned {len(ev.outputs)} outputs for "
                    f"{held.request.output_count} expected"
                )
                answer = self.answers.failed(run, held, ErrorCode.INFERENCE_FAILED, message, now)
            elif isinstance(ev, Final):
                answer = self.answers.generated(run, held, ev.outputs, r.first_token_at, now)
            elif isinstance(ev, Failed):
                failed += 1
                answer = self.answers.failed(run, held, ev.code, ev.message, now)
            else:
                continue
            out.append(self.attempt(answer, held, r.seq + 1))
        self.observers.notify(
            BatchDone(self.model, step.batch, step.step_id, tuple(h.request.id for h in step.held),
                      done.finished_at - done.started_at, done.report.out_of_memory, failed)
        )  # fmt: skip
        self.observers.notify(self._state(done, gaps))
        sink.send(out)

    def _timing(
        self, report: StepReport, named: dict[str, Running], at: float
    ) -> tuple[tuple[int, float], ...]:
        """Note when the step's requests got tokens (the step's end, ``at``): their first
        token, and the inter-token gaps it closed: (lane, seconds) per request that had had
        tokens before (across a preemption too)."""
        assert self.scheduler is not None
        running = self.scheduler.running
        produced = report.produced
        if produced is None:  # a runner that does not tell: its first delta, or its result
            produced = {ev.key: 0 for ev in report.events if isinstance(ev, Partial | Final)}
        gaps: list[tuple[int, float]] = []
        for key, n in produced.items():
            r = named.get(key)
            if r is None and (r := running.get(key)) is None:
                continue
            if r.first_token_at is None:
                r.first_token_at = at
            elif n and r.last_token_at is not None:
                gaps.append((r.held.waiting.lane, at - r.last_token_at))
            if n:
                r.last_token_at = at
        return tuple(gaps)

    def _state(self, done: StepDone, gaps: tuple[tuple[int, float], ...]) -> Generated:
        assert self.scheduler is not None
        sequences = kv_tokens = 0
        for r in self.scheduler.running.values():  # one pass: every running request, each step
            contexts = r.progress.contexts
            sequences += len(contexts)
            kv_tokens += contexts[0] if len(contexts) == 1 else sum(contexts)
        budget = self.scheduler.policy.policy
        return Generated(
            self.model,
            running=sequences,
            waiting=len(self.scheduler.held),
            waiting_sequences=self.scheduler.waiting_sequences(),
            kv_tokens=kv_tokens,
            kv_capacity=budget.kv_cache_tokens,
            preempted=sum(ev.sequences for ev in done.report.events if isinstance(ev, Preempted)),
            tokens=sum((done.report.produced or {}).values()),
            gaps=gaps,
            compiling=done.report.compiling,
            deferred=done.report.compiling_sequences,
            admitting=self._admitting(),
            compiled_s=done.report.compiled_s,
            drafted=done.report.drafted,
            accepted=done.report.accepted,
            spec_skipped=done.report.spec_skipped,
            prefilled=done.report.prefilled,
        )

    def _admitting(self) -> int:
        """The sequences of the requests that the steps in flight admit (planned once this
        one ended, or queued behind it): vLLM's scheduler has them waiting, until a step
        runs them (the step a constrained one's runner defers it in, or runs it)."""
        assert self.scheduler is not None
        running = self.scheduler.running
        return sum(len(r.progress.contexts) for step in self.scheduler.inflight
                   for h in step.held if (r := running.get(h.waiting.key)) is not None)  # fmt: skip

    def _ttl(self, held: Held) -> int:
        """The TTL of a request's result, and of its token stream and ``started`` key."""
        req = held.request
        return min(
            req.result_ttl_s or self.config.result_ttl_s, self.config.limits.max_result_ttl_s
        )

    def stream_to(self, held: Held, seq: int = 0) -> StreamTo:
        """Where a request's deltas go; ``seq``: the last one sent."""
        req = held.request
        return StreamTo(held.waiting.key, req.id, self.model, self._ttl(held), req.reply,
                        held.fmt, seq, held.entry.deliveries)  # fmt: skip

    def attempt(self, answer: Outgoing, held: Held, seq: int) -> Outgoing:
        """``answer``, stored as this attempt's at the request (see ``finish.lua``) with
        its token stream's end (number ``seq``) if it streams."""
        end = self.delta(held, seq, None).write() if held.request.stream else None
        return replace(answer, fenced=True, end=end)

    def delta(self, held: Held, seq: int, chunk: Any) -> Streamed:
        """A delta message (``chunk``: the runner's ``{"input", "text", "tokens"}``), or
        the token stream's end (``chunk`` None)."""
        return self.stream_to(held).delta(seq, chunk)

    def dispatching(self, step: Step) -> None:
        """A step is about to be submitted: tell the device thread where the deltas of the
        streaming requests it admits go."""
        assert self.scheduler is not None and self.parts.deltas is not None
        running = self.scheduler.running
        self.parts.deltas.expect(
            [self.stream_to(h, running[h.waiting.key].seq) for h in step.held if h.request.stream]
        )

    def began(self, step: Step) -> None:
        """The device began a step (at its dispatch, or once the step before it ended where
        it was queued behind it: one taken back before is not): tell Redis which requests
        it starts, their prefill under way (``started`` keys; not those it resumes after a
        preemption, started already)."""
        assert self.scheduler is not None
        running = self.scheduler.running
        fresh = [h for h in step.held
                 if (r := running.get(h.waiting.key)) is not None and r.resumed is None]  # fmt: skip
        self.parts.sink.started([(h.request.id, self._ttl(h)) for h in fresh])

    def cancel(self, request_ids: Sequence[str]) -> None:
        """Clients cancelled these: a waiting request is answered now; a running (or
        preempted) one ends with the next step, answered by its runner with its text."""
        if self.scheduler is None:
            return
        wanted = set(request_ids)
        now = self._clock()
        out: list[Outgoing] = []
        for held in self.scheduler.watched():
            if held.request.id in wanted:
                waiting = self.scheduler.stop(held.waiting.key, "cancelled")
                if waiting is not None:
                    out.append(self.attempt(self.answers.cancelled(waiting, now), waiting, 1))
        self.parts.sink.send(out)

    def lose(self, keys: set[str]) -> int:
        """These requests were taken over by other workers: drop the waiting ones, end the
        running ones with the next step, unanswered (the other worker answers them). How
        many this loop held."""
        if self.scheduler is None:
            return 0
        held = [h.waiting.key for h in self.scheduler.watched() if h.waiting.key in keys]
        for key in held:
            self.scheduler.lose(key)
        return len(held)

    def watch(self) -> None:
        """Tell the cancel watcher which requests may be cancelled now: when they changed
        (the scheduler's ``version``: the loop asks each time round, the set changes far
        less often, and listing it is O(every request held))."""
        sched = self.scheduler
        if self.parts.cancels is None or sched is None or sched.version == self._watched:
            return
        self._watched = sched.version
        self.parts.cancels.watch([h.request.id for h in sched.watched()])
