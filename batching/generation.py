"""Continuous batching for text generation: who joins, who leaves, before each device step.

Pure like the rest of ``batching/``: the loop hands :meth:`GenerationPolicy.plan` what is
waiting, what is running and the time (:mod:`.gen_types`); the answer is a
:class:`~.gen_types.GenPlan`. A plan ends requests past their deadline, preempts when the
running requests' KV memory outgrew the cache (:mod:`.gen_victims`), else admits in lane
order (:mod:`.gen_admission`, whose credit is the only state kept between calls). Memory
and the step's token budget are counted as the KV cache counts them (:mod:`.gen_blocks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .gen_admission import Admission
from .gen_blocks import admission_blocks, blocks_for, outgrew, reserved_blocks
from .gen_types import GenPlan, GenPolicy, GenRunning, GenWaiting
from .gen_victims import Victim, by_order, grouped, victims

STARVATION_SLACK = 0.25
"""A lower-lane request is promoted this fraction of ``max_starvation_ms`` before its
bound, so it is admitted by its bound when steps are shorter than that."""


class GenerationPolicy:
    """Admission, preemption, deadlines for continuous batching; state: DRR credit only."""

    def __init__(self, policy: GenPolicy) -> None:
        self._policy = policy
        self._admission = Admission()

    @property
    def policy(self) -> GenPolicy:
        return self._policy

    def set_policy(self, policy: GenPolicy) -> None:
        """Change the knobs live; the lanes' credit is kept."""
        self._policy = policy

    def credit(self) -> tuple[dict[int, float], float]:
        """The credit a plan spends (see :meth:`restore`)."""
        return self._admission.credit()

    def restore(self, credit: tuple[dict[int, float], float]) -> None:
        """Credit as :meth:`credit` returned it: a plan withdrawn before it ran (planned
        again with a newer view) spends nothing."""
        self._admission.restore(credit)

    def blocks(self, tokens: int) -> int:
        """KV blocks for a sequence of ``tokens`` tokens."""
        return blocks_for(tokens, self._policy.page_size)

    def plan(
        self, waiting: Sequence[GenWaiting], running: Sequence[GenRunning], now: float
    ) -> GenPlan:
        """Decide the next step's changes (see the module docstring and docs/batching.md).

        1. Deadlines: running past theirs are stopped, waiting past theirs expire
           (``deadline <= now``); waiting that can never fit even alone are refused.
        2. Memory short: while the running requests' reserved blocks exceed the cache,
           or their sequences ``max_running``, preempt the lowest lane, latest arrival,
           a sequence at a time where a request names them (:mod:`.gen_victims`);
           such a plan admits nothing.
        3. Admission in lane order (:class:`~.lanes.LaneScheduler`: strict priority,
           oldest first, starving lower lanes promoted and metered by lane weight) while
           slots, blocks (less the watermark) and the prefill backlog allow; the first
           candidate that does not fit ends admission, except that a lane-0 one may
           preempt lower-lane running requests if it then fits (what promotion admitted
           only on credit, once a promoted request waits past its bound, and only what
           was never preempted), and a lane-0 one behind
           a promoted request that does not fit may go by preempting at least all it
           takes.
        """
        pol = self._policy
        page = pol.page_size
        total = pol.total_blocks
        bound = pol.max_starvation_ms / 1000.0
        slack = bound * STARVATION_SLACK

        # (these two loops see every running and waiting request, every step: kept to
        # plain arithmetic, the policy's attributes read once)
        stop: list[str] = []
        live: list[GenRunning] = []
        used = seqs = 0
        for r in running:
            blocks = reserved_blocks(r, page)
            deadline = r.deadline
            if deadline is not None and deadline <= now:
                stop.append(r.key)
            elif blocks > total and outgrew(r, page, total):
                stop.append(r.key)  # alone it outgrew the cache: resuming cannot help
            else:
                live.append(r)
                used += blocks
                seqs += len(r.contexts)
        expire: list[str] = []
        refuse: list[tuple[str, str]] = []
        candidates: list[GenWaiting] = []
        room = total - pol.watermark_blocks
        max_running = pol.max_running
        for w in waiting:
            parent, deadline = w.parent, w.deadline
            if parent is not None and parent in stop:
                continue  # a sequence of a request that ends now: it ends with it
            if deadline is not None and deadline <= now:
                expire.append(w.key)
            elif len(w.prompts) > max_running or admission_blocks(w, page) > room:
                refuse.append((w.key, never_fits(w, pol)))  # not even alone, ever
            else:
                candidates.append(w)

        # 2. Memory (or slots, after a set_policy) short: free the lowest lane, latest
        # started, a sequence at a time (vLLM preempts each child of ``n > 1``).
        freed: list[Victim] = []
        if used > total or seqs > pol.max_running:
            for v in victims(by_order(live), page):
                if used <= total and seqs <= pol.max_running:
                    break
                freed.append(v)
                used -= v.blocks
                seqs -= v.slots

        # As vLLM: no admission in a plan that had to preempt for growth (the victims
        # would come back behind what took their memory).
        admit = (
            []
            if freed
            else self._admission.admit(pol, candidates, live, used, seqs, now, slack, freed)
        )

        preempt, preempt_seqs = grouped(freed)
        gone = set(preempt) | {k for k, _ in preempt_seqs}
        wake = _wake_at(candidates, live, admit, gone, now, bound - slack)
        return GenPlan(
            tuple(admit), preempt, tuple(stop), tuple(expire), wake, preempt_seqs, tuple(refuse)
        )


def never_fits(w: GenWaiting, pol: GenPolicy) -> str:
    """Why waiting request ``w`` can never start under ``pol`` (its refusal's message)."""
    n = len(w.prompts)
    what = "its sequence needs" if n == 1 else f"its {n} sequences together need"
    if n > pol.max_running:
        return f"{what} {n} slots of the running batch, over its max_running {pol.max_running}"
    room = pol.total_blocks - pol.watermark_blocks
    return (
        f"{what} {admission_blocks(w, pol.page_size)} KV cache blocks of "
        f"{pol.page_size} tokens (prompt tokens {sum(w.prompts)}, and one to generate each), "
        f"over the {room} of {pol.total_blocks} the cache admits (kv_cache_tokens "
        f"{pol.kv_cache_tokens} less the watermark)"
    )


def _wake_at(
    candidates: Iterable[GenWaiting],
    live: Iterable[GenRunning],
    admit: list[str],
    preempted: set[str],
    now: float,
    promote_after: float,
) -> float | None:
    """Earliest future deadline of anything not ended, or promotion instant of a lower-lane
    request that waits after this plan (a preempted request waits too)."""
    admitted = set(admit)
    soonest: float | None = None
    for w in candidates:  # (every waiting request: no list of times built)
        t = w.deadline
        if t is not None and t > now and (soonest is None or t < soonest):
            soonest = t
        if w.lane > 0 and w.key not in admitted:
            t = w.arrived_at + promote_after
            if t > now and (soonest is None or t < soonest):
                soonest = t
    for r in live:
        t = r.deadline
        if t is not None and t > now and (soonest is None or t < soonest):
            soonest = t
        if r.lane > 0 and r.key in preempted:
            t = r.arrived_at + promote_after
            if t > now and (soonest is None or t < soonest):
                soonest = t
    return soonest
