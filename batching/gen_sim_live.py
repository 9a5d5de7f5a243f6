"""A simulated generation request (:mod:`.gen_simulator`): its trace entry, and its
progress through admissions, steps and preemptions, whole or of some of its sequences
(each preempted sequence waits on its own and resumes into its request, as vLLM's child
requests of ``n > 1`` do)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .gen_types import GenRunning, GenWaiting


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One request of a trace: its sequences' prompts and the lengths they will generate."""

    key: str
    lane: int
    arrived: float
    prompts: tuple[int, ...]
    max_new_tokens: int
    lengths: tuple[int, ...]
    """Tokens each sequence generates before it stops by itself (each <= max_new_tokens)."""
    deadline: float | None = None


def child_key(key: str, seq: int) -> str:
    """The waiting key of sequence ``seq`` of request ``key`` preempted alone."""
    return f"{key}#{seq}"


@dataclass(slots=True)
class Live:
    """A request's progress: what it generated, and this run's prefill."""

    req: GenRequest
    generated: list[int]
    fill: list[int] = field(default_factory=list)
    """Tokens to prefill in this run, per running sequence (as ``alive``)."""
    prefilled: list[int] = field(default_factory=list)
    run_generated: list[int] = field(default_factory=list)
    alive: list[int] = field(default_factory=list)
    """Indices of the sequences running (not finished, not preempted alone)."""
    parked: list[int] = field(default_factory=list)
    """Indices of the sequences preempted alone, waiting to resume into it."""
    started_at: float = 0.0
    first_admit: float | None = None
    first_token: float | None = None
    preempted: int = 0

    @property
    def done(self) -> bool:
        return not self.alive and not self.parked

    def as_waiting(self) -> GenWaiting:
        r = self.req
        return GenWaiting(
            r.key,
            r.lane,
            r.arrived,
            r.deadline,
            tuple(self._refill(i) for i in self.alive),
            max(r.max_new_tokens - self.generated[i] for i in self.alive),
        )

    def children(self) -> list[GenWaiting]:
        """Its sequences preempted alone, each waiting on its own."""
        r = self.req
        return [
            GenWaiting(child_key(r.key, i), r.lane, r.arrived, r.deadline, (self._refill(i),),
                       r.max_new_tokens - self.generated[i], parent=r.key)
            for i in self.parked
        ]  # fmt: skip

    def _refill(self, i: int) -> int:
        """What sequence ``i`` prefills when it (re)starts: its prompt and its tokens."""
        return self.req.prompts[i] + self.generated[i]

    def start(self, now: float) -> None:
        self.fill = [self._refill(i) for i in self.alive]
        self.prefilled = [0] * len(self.alive)
        self.run_generated = [0] * len(self.alive)
        self.started_at = now
        if self.first_admit is None:
            self.first_admit = now

    def park(self, seqs: tuple[int, ...]) -> None:
        """Preempt these sequences alone; the others run on."""
        keep = [j for j, i in enumerate(self.alive) if i not in seqs]
        self.parked += [i for i in self.alive if i in seqs]
        self._keep(keep)
        self.preempted += 1

    def park_all(self) -> None:
        """Preempt it whole (with any sequences preempted alone before): it waits."""
        self.alive = sorted(self.alive + self.parked)
        self.parked = []
        self.preempted += 1

    def resume(self, seq: int) -> None:
        """A sequence preempted alone starts again, by recomputation, last of its request."""
        self.parked.remove(seq)
        self.alive.append(seq)
        self.fill.append(self._refill(seq))
        self.prefilled.append(0)
        self.run_generated.append(0)

    def as_running(self) -> GenRunning:
        r = self.req
        return GenRunning(
            r.key,
            r.lane,
            r.arrived,
            r.deadline,
            self.started_at,
            tuple(p + g for p, g in zip(self.prefilled, self.run_generated, strict=True)),
            tuple(f - p for f, p in zip(self.fill, self.prefilled, strict=True)),
            max((r.max_new_tokens - self.generated[i] for i in self.alive), default=0),
            self.preempted,
            tuple(self.alive) if len(r.prompts) > 1 else (),  # (one sequence: freed whole)
        )

    def advance(self, chunks: tuple[int, ...], now: float) -> None:
        """Apply one step: prefill chunks, a token when a prompt completes or per decode."""
        keep: list[int] = []
        for j, add in enumerate(chunks):
            i = self.alive[j]
            if self.prefilled[j] < self.fill[j]:
                self.prefilled[j] += add
                if self.prefilled[j] < self.fill[j]:
                    keep.append(j)
                    continue
            self.run_generated[j] += 1
            self.generated[i] += 1
            if self.first_token is None:
                self.first_token = now
            if self.generated[i] < self.req.lengths[i]:
                keep.append(j)
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        """Only the running sequences at positions ``keep`` stay running."""
        self.alive = [self.alive[j] for j in keep]
        self.fill = [self.fill[j] for j in keep]
        self.prefilled = [self.prefilled[j] for j in keep]
        self.run_generated = [self.run_generated[j] for j in keep]
