"""What the generation policy sees and answers: requests waiting and running, its knobs,
and the plan it returns before each device step (:mod:`.generation`).

Plain frozen values, built by the worker's scheduler (``worker/gen_states.py``) and the
simulator (:mod:`.gen_sim_live`) from their own state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


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
    """Ids of its running sequences, as ``contexts``, for a request of several: each is
    preempted on its own, as vLLM preempts the child requests of ``n > 1``, the last
    first, all of them if need be (:mod:`.gen_victims`); empty: the request is preempted
    whole (a single sequence, a beam search's rounds)."""


_RUNNING_FIELDS = ("key", "lane", "arrived_at", "deadline", "started_at", "contexts",
                   "prefill_left", "max_new_tokens_left", "preempted", "seqs")  # fmt: skip
if tuple(f.name for f in fields(GenRunning)) != _RUNNING_FIELDS:
    raise RuntimeError("GenRunning's fields changed: update running() below")
_SET_RUNNING = tuple(getattr(GenRunning, name).__set__ for name in _RUNNING_FIELDS)


def running(
    key: str,
    lane: int,
    arrived_at: float,
    deadline: float | None,
    started_at: float,
    contexts: tuple[int, ...],
    prefill_left: tuple[int, ...],
    max_new_tokens_left: int,
    preempted: int = 0,
    seqs: tuple[int, ...] = (),
) -> GenRunning:
    """``GenRunning(...)``, equal to it, at about a third of its cost: its slots set
    directly, not through the frozen dataclass's ``__init__``. The worker makes one per
    running request each plan (64 running: about 0.3 ms a step on the loop thread)."""
    r = object.__new__(GenRunning)
    s_key, s_lane, s_arrived, s_deadline, s_started, s_ctx, s_pre, s_left, s_pmt, s_seqs = (
        _SET_RUNNING
    )
    s_key(r, key)
    s_lane(r, lane)
    s_arrived(r, arrived_at)
    s_deadline(r, deadline)
    s_started(r, started_at)
    s_ctx(r, contexts)
    s_pre(r, prefill_left)
    s_left(r, max_new_tokens_left)
    s_pmt(r, preempted)
    s_seqs(r, seqs)
    return r


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
    """What to do before the next step. A key is in at most one of the six lists.

    ``admit``: waiting keys to start now, in order (their prefill is chunked by
    :func:`schedule_step`). ``preempt``: running keys to free now; they go back to waiting
    and resume by recomputation (prompt + what they generated). ``preempt_seqs``: running
    keys and some or all of their :attr:`~GenRunning.seqs` to free now, the request
    running on (with those not named, or none);
    each such sequence waits on its own (a :class:`GenWaiting` with ``parent``) and
    resumes by recomputation into its request. ``stop``: running keys to
    end now with what they generated: ``finish_reason = "deadline"`` when their deadline
    has passed, ``"length"`` when one alone outgrew the KV cache. ``expire``: waiting keys
    that end without running: their deadline passed (answered ``expired``; the policy
    cannot tell a preempted request from a new one, so the worker answers a preempted key
    that had produced tokens with ``finish_reason = "deadline"`` and its text, like a
    stop). ``refuse``: waiting keys, with why, that can never start: their sequences
    together need more blocks than the cache less the watermark, or more slots than
    ``max_running`` (answered ``invalid_request``; the worker ends a preempted one that
    no longer fits with ``finish_reason = "length"`` and its text). A key whose deadline
    passed expires rather than being refused. ``wake_at``: plan again by then if nothing
    else happens.
    """

    admit: tuple[str, ...] = ()
    preempt: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    expire: tuple[str, ...] = ()
    wake_at: float | None = None
    preempt_seqs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    refuse: tuple[tuple[str, str], ...] = ()
