"""Continuous batching for text generation: who joins, who leaves, before each device step.

Pure like the rest of ``batching/``: the loop hands :meth:`GenerationPolicy.plan` what is
waiting, what is running and the time; the answer is a :class:`GenPlan`. The only state
kept between calls is credit: the lower lanes' for promotion (:class:`~.lanes.LaneScheduler`)
and lane 0's for going ahead of them.

Memory is counted as the KV cache counts it, in whole blocks of ``page_size`` tokens per
sequence. A running sequence *reserves* ``blocks(context + prefill_left + 1)``: all of its
prompt and the next token (so a request admitted with its whole prompt's blocks is never
preempted half-prefilled by its own prefill); that is at least what the next step writes,
whatever chunk it prefills. Admission reserves the same for the new request's sequences,
so after a plan the next step's KV need (:func:`step_blocks`) never exceeds the cache.
The step's token budget is shared by :func:`schedule_step`: one token per decoding
sequence, the rest in prefill chunks, higher lanes first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .gen_victims import Victim, by_order, cover, grouped, victims
from .lanes import LaneScheduler, group_by_lane, lane_weight
from .types import Policy, Waiting

PREFILL_STEPS = 4
"""Admission stops while the prompt tokens that would prefill before a candidate (its own,
and the unprefilled tokens of running and admitted requests of its lane and higher ones)
exceed this many steps' token budgets: admitted requests then start within about that
many steps instead of holding KV memory while they queue for prefill. A request alone
over it still goes when nothing of its lane or higher lanes is prefilling."""

LANE0_BURST = 1.5
"""Lane 0 saves at most this many rows of credit to go ahead of starving lower lanes: a
longer run of lane-0 admissions ahead of them would push them past their bound."""

STARVATION_SLACK = 0.25
"""A lower-lane request is promoted this fraction of ``max_starvation_ms`` before its
bound, so it is admitted by its bound when steps are shorter than that."""


@dataclass(frozen=True, slots=True)
class GenWaiting:
    """A request not running: new, or preempted and waiting to resume by recomputation."""

    key: str
    lane: int
    """Priority lane, 0 = highest."""
    arrived_at: float
    """Seconds on the loop's clock: when it was enqueued (kept across preemptions)."""
    deadline: float | None
    """Absolute seconds; ``None`` = none."""
    prompts: tuple[int, ...]
    """Tokens to prefill per sequence (one per input); a resumed request's prompt plus
    what it generated before preemption; 0 for a sequence its runner answers when
    admitted (``max_new_tokens`` 0: the prompt only, not scored)."""
    max_new_tokens: int
    """Tokens each sequence may still generate."""
    parent: str | None = None
    """A sequence preempted alone (:attr:`GenPlan.preempt_seqs`): the running request it
    resumes into. Never admitted by a plan that stops or frees its parent."""


@dataclass(frozen=True, slots=True)
class GenRunning:
    """A request whose sequences are in the KV cache."""

    key: str
    lane: int
    arrived_at: float
    deadline: float | None
    started_at: float
    """When it was (last) admitted."""
    contexts: tuple[int, ...]
    """Tokens in the KV cache per unfinished sequence (prefilled so far + generated)."""
    prefill_left: tuple[int, ...]
    """Prompt tokens of each such sequence not yet prefilled (0 = decoding)."""
    max_new_tokens_left: int
    """The most tokens any of its sequences may still generate."""
    preempted: int = 0
    """Times it (or one of its sequences) was preempted before (and resumed)."""
    seqs: tuple[int, ...] = ()
    """Ids of its sequences, as ``contexts``: each is preempted on its own, as vLLM preempts
    the child requests of ``n > 1``, the last first (:mod:`.gen_victims`); empty: the
    request is preempted whole (a beam search's rounds)."""


@dataclass(frozen=True, slots=True)
class GenPolicy:
    """Knobs of continuous batching for one model (validated here; the worker's config
    validates the same)."""

    kv_cache_tokens: int
    """The KV cache in tokens (= blocks x page_size)."""
    page_size: int
    """KV memory is given in blocks of this many tokens, per sequence."""
    step_tokens: int
    """Per-step token budget: prefill chunks + one per decoding sequence. Must exceed
    ``max_running`` so prefill always progresses."""
    max_running: int
    """Most sequences in the running batch."""
    lanes: int = 3
    lane_weights: tuple[float, ...] = (4.0, 2.0, 1.0)
    """Shares of admissions when lanes compete, as in :class:`~.types.Policy`."""
    max_starvation_ms: float = 2000.0
    """The longest a lower-lane request waits while higher lanes take the cache."""
    watermark: float = 0.01
    """Fraction of the KV blocks admission leaves free (vLLM's watermark): running
    sequences grow into it before anything has to be preempted."""

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.kv_cache_tokens < self.page_size:
            raise ValueError("need page_size >= 1 and kv_cache_tokens >= page_size")
        if self.max_running < 1 or self.step_tokens <= self.max_running:
            raise ValueError("need max_running >= 1 and step_tokens > max_running")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark is a fraction in [0, 1)")
        if self.max_starvation_ms < 0:
            raise ValueError("max_starvation_ms must be >= 0")

    @property
    def total_blocks(self) -> int:
        return self.kv_cache_tokens // self.page_size

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.total_blocks)


@dataclass(frozen=True, slots=True)
class GenPlan:
    """What to do before the next step. A key is in at most one of the five lists.

    ``admit``: waiting keys to start now, in order (their prefill is chunked by
    :func:`schedule_step`). ``preempt``: running keys to free now; they go back to waiting
    and resume by recomputation (prompt + what they generated). ``preempt_seqs``: running
    keys and some of their :attr:`~GenRunning.seqs` to free now, the others running on;
    each such sequence waits on its own (a :class:`GenWaiting` with ``parent``) and
    resumes by recomputation into its request. ``stop``: running keys to
    end now with what they generated: ``finish_reason = "deadline"`` when their deadline
    has passed, ``"length"`` when one alone outgrew the KV cache. ``expire``: waiting keys
    that end without running: their deadline passed (answered ``expired``; the policy
    cannot tell a preempted request from a new one, so the worker answers a preempted key
    that had produced tokens with ``finish_reason = "deadline"`` and its text, like a
    stop), or they can never fit the KV cache or ``max_running`` even alone (answered as
    an invalid request). ``wake_at``: plan again by then if nothing else happens.
    """

    admit: tuple[str, ...] = ()
    preempt: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    expire: tuple[str, ...] = ()
    wake_at: float | None = None
    preempt_seqs: tuple[tuple[str, tuple[int, ...]], ...] = ()


def blocks_for(tokens: int, page_size: int) -> int:
    """KV blocks one sequence of ``tokens`` tokens holds (whole blocks)."""
    return -(-max(tokens, 0) // page_size)


def reserved_blocks(r: GenRunning, page_size: int) -> int:
    """Blocks a running request needs through the next step: each sequence's whole
    prompt plus one token (at least what the step writes, whatever the chunk)."""
    if len(r.contexts) == 1:  # the common case, planned for every running request each step
        return -(-(r.contexts[0] + r.prefill_left[0] + 1) // page_size)
    return sum(
        blocks_for(c + p + 1, page_size) for c, p in zip(r.contexts, r.prefill_left, strict=True)
    )


def admission_blocks(w: GenWaiting, page_size: int) -> int:
    """Blocks a waiting request needs to start: whole prompts plus one decode token (none
    for a sequence of no prompt tokens: its runner answers it when admitted)."""
    if len(w.prompts) == 1:
        return -(-(w.prompts[0] + 1) // page_size) if w.prompts[0] else 0
    return sum(blocks_for(p + 1, page_size) for p in w.prompts if p)


def schedule_step(running: Sequence[GenRunning], step_tokens: int) -> dict[str, tuple[int, ...]]:
    """Tokens each sequence feeds the next step (key → per sequence, in order).

    Every decoding sequence takes one token; what is left of ``step_tokens`` goes to
    prefill chunks of the prefilling sequences in lane order, then by ``started_at``
    (then key), each taking what it still needs or what is left. The worker calls this
    on the running batch after applying a plan (an admitted request is running with
    ``contexts`` of 0 and ``prefill_left`` = its prompts).
    """
    decodes = sum(1 for r in running for p in r.prefill_left if p == 0)
    left = max(step_tokens - decodes, 0)
    out: dict[str, tuple[int, ...]] = {}
    for r in sorted(running, key=lambda r: (r.lane, r.started_at, r.key)):
        chunks: list[int] = []
        for p in r.prefill_left:
            if p == 0:
                chunks.append(1)
            else:
                take = min(p, left)
                left -= take
                chunks.append(take)
        out[r.key] = tuple(chunks)
    return out


def step_blocks(
    running: Sequence[GenRunning], chunks: dict[str, tuple[int, ...]], page_size: int
) -> int:
    """KV blocks the step needs: each sequence's context plus what it adds."""
    return sum(
        blocks_for(c + a, page_size)
        for r in running
        for c, a in zip(r.contexts, chunks.get(r.key, ()), strict=True)
    )


class GenerationPolicy:
    """Admission, preemption, deadlines for continuous batching; state: DRR credit only."""

    def __init__(self, policy: GenPolicy) -> None:
        self._policy = policy
        self._lanes = LaneScheduler()
        self._lane0_credit = LANE0_BURST
        """Lane 0's weighted share of admitted rows, spent when it goes ahead of starving
        lower lanes (see :meth:`_admit`), up to :data:`LANE0_BURST` rows."""

    @property
    def policy(self) -> GenPolicy:
        return self._policy

    def set_policy(self, policy: GenPolicy) -> None:
        """Change the knobs live; the lanes' credit is kept."""
        self._policy = policy

    def credit(self) -> tuple[dict[int, float], float]:
        """The credit a plan spends (see :meth:`restore`)."""
        return dict(self._lanes._deficit), self._lane0_credit

    def restore(self, credit: tuple[dict[int, float], float]) -> None:
        """Credit as :meth:`credit` returned it: a plan withdrawn before it ran (planned
        again with a newer view) spends nothing."""
        self._lanes._deficit, self._lane0_credit = dict(credit[0]), credit[1]

    def blocks(self, tokens: int) -> int:
        """KV blocks for a sequence of ``tokens`` tokens."""
        return blocks_for(tokens, self._policy.page_size)

    def plan(
        self, waiting: Sequence[GenWaiting], running: Sequence[GenRunning], now: float
    ) -> GenPlan:
        """Decide the next step's changes (see the module docstring and docs/batching.md).

        1. Deadlines: running past theirs are stopped, waiting past theirs expire
           (``deadline <= now``).
        2. Memory short: while the running requests' reserved blocks exceed the cache,
           or their sequences ``max_running``, preempt the lowest lane, latest started,
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

        stop: list[str] = []
        live: list[GenRunning] = []
        used = seqs = 0
        for r in running:
            blocks = reserved_blocks(r, page)
            if r.deadline is not None and r.deadline <= now:
                stop.append(r.key)
            elif blocks > total:
                stop.append(r.key)  # alone it outgrew the cache: resuming cannot help
            else:
                live.append(r)
                used += blocks
                seqs += len(r.contexts)
        expire: list[str] = []
        candidates: list[GenWaiting] = []
        room = total - pol.watermark_blocks
        for w in waiting:  # (every waiting request, every step: kept to plain arithmetic)
            if w.parent is not None and w.parent in stop:
                continue  # a sequence of a request that ends now: it ends with it
            if (
                (w.deadline is not None and w.deadline <= now)
                or len(w.prompts) > pol.max_running
                or admission_blocks(w, page) > room
            ):
                expire.append(w.key)  # its deadline passed, or it can never fit even alone
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
        admit = [] if freed else self._admit(candidates, live, used, seqs, now, slack, freed)

        preempt, preempt_seqs = grouped(freed)
        gone = set(preempt) | {k for k, _ in preempt_seqs}
        wake = _wake_at(candidates, live, admit, gone, now, bound - slack)
        return GenPlan(tuple(admit), preempt, tuple(stop), tuple(expire), wake, preempt_seqs)

    def _admit(
        self,
        candidates: list[GenWaiting],
        live: list[GenRunning],
        used: int,
        seqs: int,
        now: float,
        slack: float,
        preempt: list[Victim],
    ) -> list[str]:
        """Admit in lane order while it fits; ``preempt`` grows with lane 0's victims."""
        pol = self._policy
        page = pol.page_size
        room = pol.total_blocks - pol.watermark_blocks
        if not candidates:
            return []
        if _slots_full(candidates, seqs, pol.max_running):
            return []  # (the common saturated step: the ordering below is O(waiting))
        by_key = {w.key: w for w in candidates}
        by_lane = group_by_lane([_as_waiting(w) for w in candidates])
        lane_policy = _lane_policy(pol)
        promoted, rest = self._lanes.order(by_lane, now, slack, 1, lane_policy)
        promoted_keys = {w.key for w in promoted}
        # Promoted requests go first, but lane 0 may go ahead of them while it has credit.
        promoted_q = deque(promoted)
        top_q = deque(w for w in rest if w.lane == 0)
        low_q = deque(w for w in rest if w.lane != 0)

        # Unprefilled prompt tokens per lane, running and admitted: the prefill backlog.
        backlog: dict[int, int] = {}
        for r in live:
            backlog[r.lane] = backlog.get(r.lane, 0) + sum(r.prefill_left)
        prefill_cap = PREFILL_STEPS * pol.step_tokens
        # Lane 0 may preempt lower lanes, but not what starvation promotion admitted
        # (started past its promotion instant): that would undo the bound it yields to.
        # Once a promoted request waits past its bound anyway (the lower lanes' own load
        # is past what the device serves), lane 0 may, on credit, preempt those that
        # were never preempted: no bound is left to keep, and lane 0 keeps its share.
        promote_after = pol.max_starvation_ms / 1000.0 - slack
        bound = pol.max_starvation_ms / 1000.0
        lost = any(w.arrived <= now - bound for w in promoted)
        lower: list[GenRunning] = []
        promoted_lower: list[GenRunning] = []
        for r in by_order(live):
            if r.lane == 0:
                continue
            if r.started_at < r.arrived_at + promote_after:
                lower.append(r)
            elif lost and r.preempted == 0:
                promoted_lower.append(r)
        ours = victims(lower, page)
        promoted_victims = victims(promoted_lower, page)

        admit: list[str] = []
        promoted_rows: dict[int, int] = {}
        charged = 0
        may_jump = True
        while top_q or promoted_q or low_q:
            jumped = False
            has_credit = self._lane0_credit - charged >= 1.0 - 1e-9
            if top_q and (not promoted_q or (may_jump and has_credit)):
                jumped = bool(promoted_q)
                item = top_q.popleft()
            elif promoted_q:
                item = promoted_q.popleft()
            else:
                item = low_q.popleft()
            w = by_key[item.key]
            if w.parent is not None and any(v.run.key == w.parent for v in preempt):
                continue  # its request is being freed by this plan: not back into it now
            need = admission_blocks(w, page)
            n = len(w.prompts)
            ahead = sum(v for lane, v in backlog.items() if lane <= w.lane)
            tokens = sum(w.prompts)
            fits = not (ahead and ahead + tokens > prefill_cap)
            freed: list[Victim] | None = []
            made_room = on_credit = False
            if fits and (used + need > room or seqs + n > pol.max_running):
                freed = None
                if w.lane == 0:
                    short = (used + need - room, seqs + n - pol.max_running)
                    freed = cover(ours, *short)
                    if freed is None and has_credit and promoted_victims:
                        freed = cover(ours + promoted_victims, *short)
                        on_credit = freed is not None
            if not fits or freed is None:
                if jumped:  # the starving requests it went ahead of may fit: back in line
                    top_q.appendleft(item)
                    may_jump = False
                    continue
                if item.key in promoted_keys and top_q:
                    # A promoted request that does not fit blocks the line; lane 0 behind it
                    # (no credit) may still go by freeing at least all it takes from lower
                    # lanes: the promoted request then waits for no less than before.
                    made = _lane0_room(by_key[top_q[0].key], ours, used, seqs, backlog, pol)
                    if made is not None:
                        promoted_q.appendleft(item)
                        item, freed = top_q.popleft(), made
                        w = by_key[item.key]
                        need, n, tokens = admission_blocks(w, page), len(w.prompts), sum(w.prompts)
                        made_room = True
                if not made_room:
                    break
            if freed:
                for v in freed:
                    (ours if v in ours else promoted_victims).remove(v)
                    preempt.append(v)
                    used -= v.blocks
                    seqs -= v.slots
                    backlog[v.run.lane] -= v.prefill
            admit.append(w.key)
            used += need
            seqs += n
            backlog[w.lane] = backlog.get(w.lane, 0) + tokens
            if w.key in promoted_keys:
                promoted_rows[w.lane] = promoted_rows.get(w.lane, 0) + n
            if jumped or on_credit:
                charged += n
        if admit:
            rows = sum(len(by_key[k].prompts) for k in admit)
            self._lanes.commit(by_lane, promoted_rows, rows, lane_policy, rows)
            lanes = set(by_lane) | {0}
            share = lane_weight(lane_policy, 0) / sum(lane_weight(lane_policy, x) for x in lanes)
            credit = self._lane0_credit - charged + rows * share
            self._lane0_credit = min(credit, LANE0_BURST)
        return admit


def _slots_full(candidates: Sequence[GenWaiting], seqs: int, max_running: int) -> bool:
    """Every slot is taken and no candidate is lane 0's (which alone may preempt for
    one): whoever is first in line cannot fit, so admission takes no one and spends no
    credit, as :meth:`GenerationPolicy._admit`'s loop would find after ordering them."""
    return seqs >= max_running and all(w.lane != 0 and w.prompts for w in candidates)


def _lane0_room(
    w: GenWaiting,
    victims: list[Victim],
    used: int,
    seqs: int,
    backlog: dict[int, int],
    pol: GenPolicy,
) -> list[Victim] | None:
    """Lower-lane sequences whose freeing covers all that lane-0 request ``w`` takes and
    lets it fit (so the resources anyone else waits for do not shrink); None if it cannot
    go that way (too few victims, or lane 0's own prefill backlog is full)."""
    page = pol.page_size
    need, n, tokens = admission_blocks(w, page), len(w.prompts), sum(w.prompts)
    ahead = backlog.get(0, 0)
    if ahead and ahead + tokens > PREFILL_STEPS * pol.step_tokens:
        return None
    room = pol.total_blocks - pol.watermark_blocks
    return cover(victims, max(need, used + need - room), max(n, seqs + n - pol.max_running))


def _as_waiting(w: GenWaiting) -> Waiting:
    return Waiting(w.key, w.lane, w.arrived_at, sum(w.prompts), len(w.prompts), w.deadline)


def _lane_policy(pol: GenPolicy) -> Policy:
    return Policy(
        max_batch_size=pol.max_running,
        lane_weights=pol.lane_weights,
        max_starvation_ms=pol.max_starvation_ms,
        lanes=pol.lanes,
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
    times: list[float] = []
    for w in candidates:
        if w.deadline is not None:
            times.append(w.deadline)
        if w.key not in admitted and w.lane > 0:
            times.append(w.arrived_at + promote_after)
    for r in live:
        if r.deadline is not None:
            times.append(r.deadline)
        if r.key in preempted and r.lane > 0:
            times.append(r.arrived_at + promote_after)
    future = [t for t in times if t > now]
    return min(future) if future else None
