"""A generating request's state in its scheduler, and how the admission policy sees it.

A request runs (:class:`Running`), or is preempted whole (:class:`Resume`: it waits
again, all its unfinished sequences) or a sequence at a time (:class:`Child`: as vLLM
preempts a child request of ``n > 1``, the others run on), each such sequence waiting on
its own under a key of its own, :func:`child_key`, and resuming into its running request.
Pure state of the loop thread, kept by :class:`~.gen_scheduler.GenScheduler`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ..batching.gen_types import GenRunning, GenWaiting, running
from .answers import Held
from .runner import Preempted, Progress
from .scheduler import Step


@dataclass(slots=True)
class Running:
    """A request on the device, and what the loop tracks of it."""

    held: Held
    started_at: float
    progress: Progress
    seq: int = 0
    """Deltas sent so far (the last one's ``seq``)."""
    first_token_at: float | None = None
    """When the step that generated its first token ended (a runner that does not report
    the tokens of each step: its first delta's)."""
    last_token_at: float | None = None
    """When the last step that gave it tokens ended (inter-token latency)."""
    preempted: int = 0
    """Times it (or one of its sequences) was preempted before."""
    resumed: Resume | None = None
    """Its state when it waited preempted, until the step resuming it runs."""
    lost: bool = False
    """Another worker took it over: it ends with the next step, unanswered."""


@dataclass(frozen=True, slots=True)
class Resume:
    """A preempted request's state when it waits again."""

    prompts: tuple[int, ...]
    max_new_tokens: int
    first_token_at: float | None
    last_token_at: float | None
    seq: int
    started_at: float
    preempted: int = 1
    """Times it was preempted, this one included."""
    seqs: tuple[int, ...] = ()
    """The index of each of ``prompts``' sequences in the request (empty: not named)."""


@dataclass(frozen=True, slots=True)
class Child:
    """A sequence preempted alone: it resumes into running request ``parent``."""

    parent: str
    seq: int
    """Its index in the request (as :attr:`~.runner.Progress.seqs`)."""
    prompt: int
    """Tokens it prefills when it resumes: its prompt and what it generated."""
    max_new_tokens: int


def child_key(parent: str, seq: int) -> str:
    """The waiting key of sequence ``seq`` of request ``parent`` (as the runner names the
    sequence; request keys are stream entry keys, which hold no ``#``)."""
    return f"{parent}#{seq}"


class Children:
    """The sequences preempted alone of the running requests, by waiting key."""

    def __init__(self) -> None:
        self.waiting: dict[str, Child] = {}
        self.resumed: dict[str, list[Child]] = {}
        """By step in flight: those it resumes (waiting again if it is taken back)."""

    def park(self, ev: Preempted) -> None:
        """A runner freed sequences alone (an ``alone`` event): they wait."""
        for seq, prompt in zip(ev.seqs, ev.prompts, strict=True):
            self.waiting[child_key(ev.key, seq)] = Child(ev.key, seq, prompt, ev.max_new_tokens)

    def drop(self, parent: str) -> None:
        """Its request ended, or was preempted whole (they wait with it now)."""
        if self.waiting:
            self.waiting = {k: c for k, c in self.waiting.items() if c.parent != parent}

    def views(self, running: Mapping[str, Running], skip: set[str]) -> list[GenWaiting]:
        """The policy's view of those whose request runs and is not in ``skip`` (a step in
        flight ends or frees it, or a stop waits for it)."""
        out: list[GenWaiting] = []
        for key, c in self.waiting.items():
            r = running.get(c.parent)
            if r is not None and c.parent not in skip:
                w = r.held.waiting
                out.append(GenWaiting(key, w.lane, w.arrived, w.deadline, (c.prompt,),
                                      c.max_new_tokens, c.parent))  # fmt: skip
        return out

    @staticmethod
    def freeing(inflight: Iterable[Step]) -> dict[str, set[int]]:
        """Sequences that steps in flight free alone, by request (planned without them)."""
        out: dict[str, set[int]] = {}
        for s in inflight:
            for k, seqs in s.preempt_seqs:
                out.setdefault(k, set()).update(seqs)
        return out

    def take(
        self, admit: Iterable[str], running: Mapping[str, Running], stops: Mapping[str, str]
    ) -> list[Child]:
        """Those a plan resumes, added to their requests' progress (those of a request
        stopping now stay, to end with it)."""
        out: list[Child] = []
        for k in admit:
            c = self.waiting.get(k)
            if c is not None and c.parent in running and c.parent not in stops:
                del self.waiting[k]
                r = running[c.parent]
                r.progress = with_children(r.progress, (c,))
                out.append(c)
        return out

    @staticmethod
    def resuming(
        resumed: Iterable[Child], running: Mapping[str, Running]
    ) -> tuple[tuple[str, tuple[int, ...], int], ...]:
        """A step's ``resume``: per request, its sequences and its lane."""
        by: dict[str, list[int]] = {}
        for c in resumed:
            by.setdefault(c.parent, []).append(c.seq)
        return tuple((k, tuple(seqs), running[k].held.waiting.lane) for k, seqs in by.items())

    def unresume(self, step_id: str, running: Mapping[str, Running]) -> None:
        """A step taken back: the sequences it resumed wait again."""
        for c in self.resumed.pop(step_id, ()):
            self.waiting[child_key(c.parent, c.seq)] = c
            if (r := running.get(c.parent)) is not None:
                r.progress = without(r.progress, (c.seq,))


def prompts_of(h: Held) -> tuple[int, ...]:
    """Tokens each sequence of a new request prefills."""
    p = h.prepared
    return p.prompts or tuple(p.tokens for _ in range(p.rows))


class WaitingViews:
    """The policy's view of each waiting request, new or preempted whole: made again only
    when it was preempted or resumed since (every waiting request is planned each step,
    most of them unchanged)."""

    def __init__(self) -> None:
        self._views: dict[str, tuple[Held, Resume | None, GenWaiting]] = {}

    def of_all(
        self, held: Mapping[str, Held], resume: Mapping[str, Resume], skip: set[str]
    ) -> list[GenWaiting]:
        """The views of those ``held`` not in ``skip``, in order (``resume``: the state of
        those preempted): remade only where it changed (each plan sees every waiting one)."""
        views = self._views
        out: list[GenWaiting] = []
        for k, h in held.items():
            if k in skip:
                continue
            res = resume.get(k) if resume else None
            known = views.get(k)
            if known is not None and known[0] is h and known[1] is res:
                out.append(known[2])
            else:
                out.append(self._make(h, res, held))
                views = self._views  # (pruned: a new dict)
        return out

    def _make(self, h: Held, res: Resume | None, held: Mapping[str, Held]) -> GenWaiting:
        w = h.waiting
        prompts = res.prompts if res else prompts_of(h)
        left = res.max_new_tokens if res else h.prepared.max_new_tokens
        view = GenWaiting(w.key, w.lane, w.arrived, w.deadline, prompts, left)
        if len(self._views) > 2 * len(held) + 64:  # those no longer waiting
            self._views = {k: v for k, v in self._views.items() if k in held}
        self._views[w.key] = (h, res, view)
        return view


def with_children(p: Progress, children: Iterable[Child]) -> Progress:
    """A running request's progress with sequences resumed into it (nothing prefilled)."""
    cs = list(children)
    return Progress((*p.contexts, *(0 for _ in cs)), (*p.prefill_left, *(c.prompt for c in cs)),
                    max(p.max_new_tokens_left, *(c.max_new_tokens for c in cs)),
                    (*p.seqs, *(c.seq for c in cs)))  # fmt: skip


def without(p: Progress, seqs: Iterable[int]) -> Progress:
    """A running request's progress less some of its named sequences."""
    gone = set(seqs)
    if not p.seqs or not gone:
        return p
    keep = [j for j, s in enumerate(p.seqs) if s not in gone]
    return replace(p, contexts=tuple(p.contexts[j] for j in keep),
                   prefill_left=tuple(p.prefill_left[j] for j in keep),
                   seqs=tuple(p.seqs[j] for j in keep))  # fmt: skip


def running_view(
    key: str, r: Running, ahead: int = 0, freeing: set[int] | None = None
) -> GenRunning | None:
    """The policy's view of a running request once the ``ahead`` steps in flight are
    done: a decoding sequence a token longer per step, less the sequences they free
    alone (``freeing``); None if they end it. Made for every running request each plan:
    kept to plain arithmetic, and built without the frozen dataclass's ``__init__``."""
    w = r.held.waiting
    p = without(r.progress, freeing) if freeing else r.progress
    contexts = p.contexts
    prefill = p.prefill_left
    left = p.max_new_tokens_left
    if ahead and contexts and not (prefill[0] if len(prefill) == 1 else any(prefill)):
        if left <= ahead:
            return None  # its last token is in flight: it leaves with that step
        contexts = ((contexts[0] + ahead,) if len(contexts) == 1  # (the common case)
                    else tuple(c + ahead for c in contexts))  # fmt: skip
        left -= ahead
    return running(key, w.lane, w.arrived, w.deadline, r.started_at, contexts, prefill, left,
                   r.preempted, p.seqs)  # fmt: skip
