"""Who a generation plan preempts: sequences, in vLLM V1's order.

vLLM fans a request of ``n`` completions (or several prompts) out into child requests,
and its scheduler preempts each child on its own, so a memory squeeze frees only as much
as it needs and the other children keep generating; a preempted child waits on its own
and resumes alone, as soon as its blocks are free. Here a running request's sequences
are such children when it names them (:attr:`~.gen_types.GenRunning.seqs`): each is a
unit of preemption, its last running one too (the request then runs on with none, its
sequences waiting to resume into it one at a time); one that names none (a single
sequence, or a beam search's rounds, whose beams are chosen together) is freed whole.
Pure: plain arithmetic on the policy's views.

What vLLM does (``vllm/v1/core/sched/scheduler.py`` at commit b4622cf924bc, read from
vllm-project/vllm; ``Scheduler.schedule()``, the running-requests loop, about lines
426-476, counted by hand in the stored copy): when ``kv_cache_manager.allocate_slots``
cannot give a running request its next blocks, it preempts one request and tries again,

- with ``SchedulingPolicy.PRIORITY``: ``max(self.running, key=lambda r: (r.priority,
  r.arrival_time))`` (about line 442), the lowest priority (highest number), then the
  latest arrival; among equal keys ``max`` returns the first in ``self.running`` order;
- else (FCFS, the default): ``self.running.pop()`` (about line 466), the last request
  in ``self.running``, which appends each request it admits or resumes;

until the request fits or it preempted the request itself. ``_preempt_request`` frees its
blocks and *prepends* it to the waiting queue (resumed first), and a step that preempted
admits nothing new (``if not preempted_reqs:`` before the waiting loop). A request of
``n > 1`` reaches the scheduler as ``n`` child requests ``f"{index}_{request_id}"``
(``vllm/v1/engine/parallel_sampling.py``, ``ParentRequest.get_child_info``), added in
index order, copies of one request with one ``arrival_time``.

Ours: lanes are vLLM's priorities, so requests go in its priority order: lowest lane,
then latest ``arrived_at`` (ties: latest started, then key). A request's own sequences
go last first: vLLM's FCFS order (the child admitted or resumed last; a resumed one is
appended to :attr:`~.gen_types.GenRunning.seqs`, so it goes first again, as in
``self.running``). Under priority scheduling vLLM's ``max`` would take the *first*
sibling, its children tying on ``(priority, arrival_time)``: an accident of ``max``, not
a rule, and the last loses the least (chunked prefill reached it last; a resumed one
recomputed least), so we keep last first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .gen_types import GenRunning


@dataclass(frozen=True, slots=True)
class Victim:
    """What one preemption frees: sequence ``seq`` of request ``run`` (None: the whole
    request, its sequences not named)."""

    run: GenRunning
    seq: int | None
    blocks: int
    """KV blocks it reserves through the next step (see ``reserved_blocks``)."""
    slots: int
    """Sequences it takes of ``max_running``."""
    prefill: int
    """Its prompt tokens not yet prefilled (the prefill backlog it leaves)."""


def by_order(running: Iterable[GenRunning]) -> list[GenRunning]:
    """Requests in preemption order: lowest lane (highest number) first, then the latest
    arrival (vLLM's priority rule, see above; ties by start, then key, so the order is
    deterministic)."""
    return sorted(running, key=lambda r: (r.lane, r.arrived_at, r.started_at, r.key), reverse=True)


def victims(ordered: Iterable[GenRunning], page_size: int) -> list[Victim]:
    """The preemption units of requests already in preemption order: each sequence of a
    request that names them, the last one first (vLLM pops the child added last), else
    the request whole. Units that free nothing (a request whose running sequences all
    ended or were freed while others wait preempted) are left out."""
    out: list[Victim] = []
    for r in ordered:
        if r.seqs:
            for pos in range(len(r.seqs) - 1, -1, -1):
                c, p = r.contexts[pos], r.prefill_left[pos]
                out.append(Victim(r, r.seqs[pos], -(-(c + p + 1) // page_size), 1, p))
        elif r.contexts:
            blocks = sum(-(-(c + p + 1) // page_size)
                         for c, p in zip(r.contexts, r.prefill_left, strict=True))  # fmt: skip
            out.append(Victim(r, None, blocks, len(r.contexts), sum(r.prefill_left)))
    return out


def cover(units: Sequence[Victim], blocks: int, slots: int) -> list[Victim] | None:
    """The fewest of ``units``, in their order, whose freeing covers ``blocks`` and
    ``slots``; None if all of them together would not."""
    taken: list[Victim] = []
    for v in units:
        if blocks <= 0 and slots <= 0:
            break
        taken.append(v)
        blocks -= v.blocks
        slots -= v.slots
    if blocks > 0 or slots > 0:
        return None
    return taken


def grouped(
    freed: Iterable[Victim],
) -> tuple[tuple[str, ...], tuple[tuple[str, tuple[int, ...]], ...]]:
    """The plan's ``preempt`` (requests freed whole: they name no sequences) and
    ``preempt_seqs`` (the others: key and sequences, in order, all of them if need be),
    each request once, in the order first freed."""
    by_key: dict[str, list[Victim]] = {}
    for v in freed:
        by_key.setdefault(v.run.key, []).append(v)
    whole: list[str] = []
    part: list[tuple[str, tuple[int, ...]]] = []
    for key, vs in by_key.items():
        if vs[0].seq is None:
            whole.append(key)
        else:
            part.append((key, tuple(sorted(v.seq for v in vs if v.seq is not None))))
    return tuple(whole), tuple(part)
