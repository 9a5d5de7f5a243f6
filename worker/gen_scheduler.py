"""The scheduler of a generating model: requests that live across many device steps.

Like :class:`~.scheduler.Scheduler` it is pure state owned by the loop thread, and
answers the same calls; what differs is that an admitted request keeps running, step
after step, until its runner reports it finished. Before each step it asks the admission
policy (``batching/generation.py``) which waiting requests join, which running ones are
preempted (freed, resumed later) or stopped at their deadline, which waiting ones
expire, and which can never start (answered ``invalid_request``, :data:`REFUSED`);
cancellations asked for by clients are passed on with the next step, and so is
a :data:`~.runner.LOST` stop for each request failed without its runner ending it
(``StepReport.abandoned``: the step's hand-off failed), which it may still be running;
the stops of a step whose runner raised are passed on again (``StepReport.crashed``).

Without ``ahead`` one step is on the device at a time, and the next is planned from what
the last one reported: the device waits for the loop between steps (the step's hand-off
through the loop thread, its planning and dispatch: about 1.2 ms a step on 2 CPU cores,
9% of a saturated tiny model's device time). With ``ahead`` the next step is planned and
queued while one runs, from the state one step old, projected: a decoding sequence's
context grows by a token a step, and one whose last token that is leaves. Requests that
an in-flight step ends or frees are left out of planning until its report is in, so a
stop or a preemption is never asked twice; a request its runner ends anyway (a step out
of memory parked it) is still answered once. The loop takes the queued step back
(:meth:`withdraw`) and plans it again when a request comes that may join it or a client
cancels, unless the device has started it.

The policy preempts a request of one sequence whole, and the sequences of a request of
several alone (vLLM's child requests of ``n > 1``), all of them if need be: those wait on
their own and resume into their request, one at a time as memory allows
(:mod:`.gen_states`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

from ..batching.gen_types import GenPolicy
from ..batching.generation import GenerationPolicy
from ..batching.types import Batch
from .answers import Held
from .gen_states import Children, Resume, Running, WaitingViews, prompts_of, running_view
from .runner import LOST, Failed, Final, Partial, Preempted, Progress, StepReport
from .scheduler import Decision, Step, step_ids
from .streams import Entry

_ENDS = (Final, Failed)
"""The events that end a request."""

REFUSED = "this request can never start on this worker"
"""How the ``invalid_request`` answer of a request the policy refuses begins (its
sequences can never fit the KV cache or the running batch together)."""


class GenScheduler:
    """Request state of one generating model; the loop thread alone calls it."""

    continuous = True

    def __init__(
        self,
        policy: GenerationPolicy,
        new_id: Callable[[], str] | None = None,
        *,
        ahead: bool = False,
    ) -> None:
        self.policy = policy
        self.ahead = ahead
        """Plan the next step while one runs (see the module's docstring)."""
        self.held: dict[str, Held] = {}
        """Waiting: new, or preempted (see ``_resume``)."""
        self.running: dict[str, Running] = {}
        self.inflight: deque[Step] = deque()
        self._resume: dict[str, Resume] = {}
        self._stops: dict[str, str] = {}
        self._step_tokens: int | None = None
        """A step budget changed live, for the runner with the next step."""
        self._new_id = new_id or step_ids()
        self._credit: tuple[str, tuple[dict[int, float], float]] | None = None
        """The queued step's id and the policy's credit before it was planned."""
        self.version = 0
        """Bumped whenever the set of entries held changes (see :meth:`holding`)."""
        self._views = WaitingViews()
        self.children = Children()
        """Sequences of running requests preempted alone, waiting to resume into them."""

    # --- state ------------------------------------------------------------------------------

    def admit(self, held: Held) -> None:
        self.held[held.waiting.key] = held
        self.version += 1

    @property
    def busy(self) -> bool:
        """A step is on the device, or requests are running (more steps to come)."""
        return bool(self.inflight or self.running)

    @property
    def holds_suspect(self) -> bool:
        return False  # a generation runs its redelivered requests like any other

    def release_all(self) -> list[Held]:
        """Forget every waiting request (they go back to the fleet)."""
        held = list(self.held.values())
        self.held.clear()
        self._resume.clear()
        self.version += 1
        return held

    def release_running(self) -> list[Held]:
        """Forget the running requests too (the device is gone: shutdown)."""
        held = [r.held for r in self.running.values()]
        self.running.clear()
        self._stops.clear()
        self.children.waiting.clear()
        self.version += 1
        return held

    def cancel(self, step_ids: list[str]) -> list[Held]:
        """Steps queued behind the running one and taken back (stopping): the requests
        they admitted are returned (the caller hands them back; they no longer run), the
        stops they carried wait for the next step."""
        wanted = set(step_ids)
        out: list[Held] = []
        for step in [s for s in self.inflight if s.step_id in wanted]:
            self.inflight.remove(step)
            for h in step.held:
                self.running.pop(h.waiting.key, None)
                self._resume.pop(h.waiting.key, None)
                out.append(h)
            self._restop(step)
            self.children.unresume(step.step_id, self.running)
        if out:
            self.version += 1
        return out

    def stop(self, key: str, reason: str) -> Held | None:
        """End a request: a waiting one is returned (answer it now); a running one, or a
        preempted one (its runner keeps its text), ends with the next step and its runner
        answers it with what it produced."""
        if key in self._resume:
            self._unpark(key)
        if key in self.running:
            self._stops.setdefault(key, reason)
            return None
        self.version += 1
        return self.held.pop(key, None)

    def lose(self, key: str) -> Held | None:
        """Another worker took this request over: a waiting one is dropped (returned); a
        running or preempted one ends with the next step, and is not answered."""
        if key in self._resume:
            self._unpark(key)
        r = self.running.get(key)
        self.version += 1
        if r is not None:
            r.lost = True
            self._stops[key] = LOST
            return None
        return self.held.pop(key, None)

    def _restop(self, step: Step) -> None:
        """A step taken back: its stops wait for the next step (of the requests still
        running, and the abandoned ones, no longer running but maybe still in the runner)."""
        for key, reason in step.stop:
            if key in self.running or reason == LOST:
                self._stops.setdefault(key, reason)

    def _unpark(self, key: str) -> None:
        """A preempted request back among the running, to be ended by its runner."""
        res = self._resume.pop(key)
        held = self.held.pop(key)
        self.running[key] = Running(
            held,
            res.started_at,
            Progress((), (), 0),
            seq=res.seq,
            first_token_at=res.first_token_at,
            last_token_at=res.last_token_at,
        )

    def set_budgets(self, policy: GenPolicy) -> None:
        """Budgets changed live (``bf_policy``): the admission policy plans with them from
        the next step, which also takes a changed step budget to the runner. Fewer
        ``max_running`` than run now: the policy preempts the excess (lowest lane first)."""
        if policy.step_tokens != self.policy.policy.step_tokens:
            self._step_tokens = policy.step_tokens
        self.policy.set_policy(policy)

    def waiting_sequences(self) -> int:
        """The sequences of the waiting requests, as vLLM counts its waiting requests: each
        of a request's ``n`` completions (vLLM's parallel sampling fans ``n`` out into as
        many requests); a preempted one's unfinished ones; a beam search's inputs (its
        first round is a request per prompt)."""
        resume = self._resume
        n = len(self.children.waiting)
        for k, h in self.held.items():  # (every waiting request, each step: a plain loop)
            if resume and (res := resume.get(k)) is not None:
                n += len(res.prompts)
            else:
                req = h.request
                n += req.input_count if req.use_beam_search else h.prepared.rows
        return n

    def read_budget(self) -> int:
        """Read enough to keep the admission policy choosing (about two batches' worth)."""
        room = 2 * self.policy.policy.max_running - len(self.held) - len(self.running)
        return max(0, room)

    def lane0_reads(self) -> int:
        """Lane-0 requests to read even when ``read_budget`` is spent: up to an eighth of
        ``max_running`` (at least one) waiting here. Without it a hold full of lower lanes'
        requests stops all reading, and a lane-0 request waits in Redis until one of those
        ends, where the admission policy could have preempted for it at once."""
        reserve = max(1, self.policy.policy.max_running // 8)
        waiting = sum(1 for h in self.held.values() if h.waiting.lane == 0)
        return max(0, reserve - waiting)

    def holding(self) -> tuple[Entry, ...]:
        """The stream entries of every request held: waiting (preempted too) or running
        (not those lost to another worker, ending)."""
        return (*(h.entry for h in self.held.values()),
                *(r.held.entry for r in self.running.values() if not r.lost))  # fmt: skip

    def adapters_waiting(self) -> list[tuple[str, str | None]]:
        """Any thread (a metrics scrape): the key and LoRA adapter of each request waiting
        here, new (read, not admitted yet) or preempted."""
        return [(h.waiting.key, h.request.lora) for h in tuple(self.held.values())]

    @property
    def busy_since(self) -> float | None:
        """When the step on the device began (None: none is)."""
        return self.inflight[0].started_at if self.inflight else None

    def watched(self) -> list[Held]:
        """Requests a client may cancel now: waiting and running."""
        return [*self.held.values(), *(r.held for r in self.running.values())]

    # --- deciding ---------------------------------------------------------------------------

    def decide(self, now: float, *, behind: bool = False, dispatch: bool = True) -> Decision:
        """The next step, when none is on the device. ``dispatch`` False (stopping): admit
        nothing, but keep stepping the running requests to their end."""
        ahead = len(self.inflight)
        if ahead > (1 if self.ahead else 0):
            return Decision(None, [], None)
        transit = self._transit()
        credit = self.policy.credit() if ahead else None
        waiting = self._views.of_all(self.held, self._resume, transit)
        freeing = self.children.freeing(self.inflight)
        running = [
            g
            for k, r in self.running.items()
            if k not in self._stops and k not in transit
            and (g := running_view(k, r, ahead, freeing.get(k)))
        ]  # fmt: skip
        # (stopping: no new request starts, but sequences preempted alone resume, so
        # their requests end)
        children = self.children.views(self.running, transit | set(self._stops))
        plan = self.policy.plan([*waiting, *children] if dispatch else children, running, now)
        never = dict(plan.refuse)
        for k in (*plan.expire, *never):  # a preempted one generated: it stops, with its text
            if k in self._resume:  # past its deadline, or its sequences outgrew the cache
                self._unpark(k)
                self._stops.setdefault(k, _why_ended(self.running[k], now))
            elif (c := self.children.waiting.pop(k, None)) is not None:  # its request too
                self._stops.setdefault(c.parent, _why_ended(self.running[c.parent], now))
        expired = [h for k in plan.expire if (h := self.held.pop(k, None)) is not None]
        refused = [(h, f"{REFUSED}: {never[k]}") for k in never
                   if (h := self.held.pop(k, None)) is not None]  # fmt: skip
        if expired or refused:
            self.version += 1
        stops = {k: why for k, why in self._stops.items() if k not in transit}
        for k in plan.stop:  # past its deadline, or grown past the whole cache
            stops.setdefault(k, _why_ended(self.running[k], now))
        for k in stops:
            self._stops.pop(k, None)
        admitted = [h for k in (plan.admit if dispatch else ()) if (h := self.held.pop(k, None))]
        resumed = self.children.take(plan.admit, self.running, stops)
        for h in admitted:
            key = h.waiting.key
            res = self._resume.pop(key, None)
            if res is None:
                rows = h.prepared.rows
                seqs = () if h.request.use_beam_search or rows == 1 else tuple(range(rows))
                self.running[key] = Running(
                    h, now, Progress((0,) * rows, prompts_of(h), h.prepared.max_new_tokens, seqs)
                )
            else:
                self.running[key] = Running(
                    h, res.started_at, Progress(tuple(0 for _ in res.prompts), res.prompts,
                                                res.max_new_tokens, _named(h, res.seqs)),
                    seq=res.seq, first_token_at=res.first_token_at,
                    last_token_at=res.last_token_at, preempted=res.preempted, resumed=res,
                )  # fmt: skip
        parts = tuple((k, seqs) for k, seqs in plan.preempt_seqs if k not in stops)
        if not (admitted or stops or plan.preempt or parts or resumed
                or (running if ahead else self.running)):  # fmt: skip
            return Decision(None, expired, plan.wake_at, refused)  # (ahead: ends in flight)
        batch = Batch(tuple(h.waiting for h in admitted), "step")
        step = Step(self._new_id(), batch, admitted, now, tuple(stops.items()),
                    tuple(k for k in plan.preempt if k in self.running and k not in stops),
                    self._step_tokens, parts, self.children.resuming(resumed, self.running))  # fmt: skip
        if resumed:
            self.children.resumed[step.step_id] = resumed
        self._step_tokens = None
        self.inflight.append(step)
        self._credit = (step.step_id, credit) if credit is not None else None
        return Decision(step, expired, plan.wake_at, refused)

    def withdraw(self, step_id: str) -> None:
        """Take back the step queued behind the running one, not started (the loop plans
        it again with what came since: a lane-0 request, a cancellation): what it admitted
        waits again, its stops wait for the next step, its credit is given back."""
        step = self.inflight.pop()
        if step.step_id != step_id or not self.inflight:
            raise RuntimeError(f"step {step_id} is not the one queued behind the running one")
        for h in step.held:
            key = h.waiting.key
            r = self.running.pop(key)
            self.held[key] = h
            if r.resumed is not None:
                self._resume[key] = r.resumed
        self._restop(step)
        self.children.unresume(step_id, self.running)
        if step.step_tokens is not None and self._step_tokens is None:
            self._step_tokens = step.step_tokens
        if self._credit is not None and self._credit[0] == step_id:
            self.policy.restore(self._credit[1])
        self._credit = None
        self.version += 1

    @property
    def room(self) -> bool:
        """The running batch has a free slot (a new arrival could join the next step)."""
        return len(self.running) < self.policy.policy.max_running

    @property
    def queued(self) -> str | None:
        """The step queued behind the running one (planned ahead), if any."""
        return self.inflight[-1].step_id if len(self.inflight) > 1 else None

    def _transit(self) -> set[str]:
        """Requests that steps in flight end or free (planned once their reports are in)."""
        return {k for s in self.inflight for k in (*s.preempt, *(k for k, _ in s.stop))}

    # --- learning ---------------------------------------------------------------------------

    def finished(
        self, step_id: str, report: StepReport, started_at: float, finished_at: float
    ) -> tuple[Step, dict[str, Running]]:
        """Take back a finished step: who ended, who was preempted, where the rest stand.
        Returns the step and the running state of every request its events name (those
        that ended are no longer running), its ``seq`` past the step's deltas."""
        step = self.inflight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"step {step_id} finished, but {step.step_id} was first")
        step.started_at = started_at
        self.children.resumed.pop(step_id, None)
        if self.inflight:  # the next one began as this one ended
            self.inflight[0].started_at = finished_at
        events = report.events  # (a token a running request: a few passes, each lean)
        if self._resume:
            for ev in events:  # parked by its runner (out of memory), ended by a stop
                if isinstance(ev, _ENDS) and ev.key in self._resume:  # planned before
                    self._unpark(ev.key)
        running = self.running
        named: dict[str, Running] = {}
        for ev in events:
            if (r := running.get(ev.key)) is not None:
                named[ev.key] = r
                if isinstance(ev, Partial):  # as the device thread numbered them (before a
                    r.seq += 1  # Resume saves it)
        for h in step.held:  # admitted by it: they started when it did (planned ahead: later)
            r = running.get(h.waiting.key)
            if r is not None and r.resumed is None:
                r.started_at = started_at
        for ev in events:
            if isinstance(ev, Partial):
                continue  # (streamed already: nothing changes here)
            r = running.get(ev.key)
            if r is None and isinstance(ev, _ENDS) and ev.key in self._resume:
                self._unpark(ev.key)  # parked earlier in these events (a crashed step's
                r = running[ev.key]  # preemption, carried over), then stopped
            if r is None:
                if isinstance(ev, _ENDS):  # (abandoned before: ended, not to stop)
                    self._stops.pop(ev.key, None)
                continue
            if isinstance(ev, _ENDS):
                del self.running[ev.key]
                self._stops.pop(ev.key, None)
                self.children.drop(ev.key)
                self.version += 1
            elif isinstance(ev, Preempted) and ev.alone:  # its other sequences run on
                self.children.park(ev)
                r.preempted += 1
            elif isinstance(ev, Preempted):
                self.children.drop(ev.key)  # (they wait with it)
                del self.running[ev.key]
                r.resumed = None
                self.held[ev.key] = r.held
                self._resume[ev.key] = Resume(ev.prompts, ev.max_new_tokens, r.first_token_at,
                                              r.last_token_at, r.seq, r.started_at,
                                              r.preempted + 1, ev.seqs)  # fmt: skip
                if ev.key in self._stops:  # cancelled while being preempted: end it parked
                    self._unpark(ev.key)
        for key in report.abandoned:  # failed here, maybe still run by the runner: stop it
            if key not in self.running and key not in self.held:
                self._stops[key] = LOST
        if report.crashed == 1:  # its runner raised, its stops maybe not applied: again
            self._restop(step)  # (a second crash in a row empties the runner: none needed)
        report.settle()  # done already where a DeltaWriter posted it (the device thread)
        for key, progress in report.progress.items():
            if (r := running.get(key)) is not None:
                r.progress = progress
                r.resumed = None  # it ran: withdrawing a later step never parks it again
        if report.out_of_memory:  # the runner halved its step budget (see its docstring)
            pol = self.policy.policy
            self.policy.set_policy(
                replace(pol, step_tokens=max(pol.page_size, pol.step_tokens // 2))
            )
        return step, named


def _named(h: Held, seqs: tuple[int, ...]) -> tuple[int, ...]:
    """The sequences the policy preempts one at a time: those of a request of several
    (a single sequence is preempted whole, as its runner reports it)."""
    return seqs if h.prepared.rows > 1 else ()


def _why_ended(r: Running, now: float) -> str:
    """The finish reason of a request the policy ended or expired, having generated:
    ``deadline`` when its deadline passed, else ``length`` (it can no longer fit)."""
    deadline = r.held.waiting.deadline
    return "deadline" if deadline is not None and deadline <= now else "length"
