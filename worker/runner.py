"""The runner seam: what the worker needs from a model.

A runner owns one loaded model on one device. The worker calls it from two threads:

- ``prepare_many(requests)`` on the loop thread, as requests arrive (CPU work: tokenize,
  decode images...). Each request becomes a :class:`Prepared` carrying the runner's own
  payload and the cost features the batching engine plans with (rows, tokens).
- ``step(work)`` on the device thread. A step admits requests and returns
  :class:`StepReport` events: a final output, a partial output, or a failure per request.
  Requests of a one-shot model (an encoder) finish in the step that admits them; a
  generator would keep some running across steps and stream partial outputs.

:class:`BatchRunner` is the base for one-shot models: implement ``encode(texts)`` and
``run(rows)``; it isolates a failing request by bisecting its batch and splits a batch
that runs out of memory. Write your own runner by subclassing it (see
docs/runners.md), or implement :class:`Runner` directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from ..schemas.errors import BatchfleetError, ErrorCode
from ..schemas.inputs import AnyInput, Kind, Ranking, kind_of
from ..schemas.messages import Request

logger = logging.getLogger(__name__)


class PrepareError(BatchfleetError):
    """A request that the runner cannot take (its inputs); answered as an error result."""

    code = ErrorCode.INVALID_REQUEST


class InvalidInput(PrepareError):
    """An input the model cannot take (a corrupt image, a kind it does not take)."""

    code = ErrorCode.INVALID_INPUT


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request made ready on the CPU side, with the cost features batching plans by."""

    payload: Any
    """The runner's own (for :class:`BatchRunner`: the request's encoded rows)."""
    rows: int
    """Rows it adds to a batch."""
    tokens: int
    """Its longest row's token count, or an image's patch count (a batch is padded to its
    longest row)."""
    truncated: tuple[bool, ...] | None = None
    """Per input: was it cut to the model's limit? (reported in the result)"""
    prompts: tuple[int, ...] = ()
    """Generating runners: prompt tokens per sequence (what the KV cache will hold; 0: a
    sequence answered when admitted, with nothing to generate or score)."""
    input_tokens: int = 0
    """One-shot runners: tokens over all its rows (an image's: its patches), the result's
    ``usage.prompt_tokens``."""
    max_new_tokens: int = 0
    """Generating runners: the most tokens a sequence of it may generate."""


@dataclass(frozen=True, slots=True)
class Work:
    """One device step: the requests it admits, by the scheduler's key, and (continuous
    runners) the running requests it ends or frees first."""

    step_id: str
    admit: tuple[tuple[str, Prepared], ...]
    stop: tuple[tuple[str, str], ...] = ()
    """Running requests to end now, with the reason (``cancelled``, ``deadline``, or
    :data:`LOST`): the runner answers each with a :class:`Final` holding what it produced so
    far (for :data:`LOST`, which nobody reads, without streaming it). A key it no longer
    holds is ignored."""
    preempt: tuple[str, ...] = ()
    """Running requests to free (their memory) and keep aside: they are admitted again
    later, and the runner resumes them (by recomputation). Reported :class:`Preempted`."""
    lanes: tuple[int, ...] = ()
    """The lane of each of ``admit`` (empty: all lane 0); a generator prefills lower lanes
    first, so a lane-0 prompt does not queue behind lower lanes' admitted prompts."""
    step_tokens: int | None = None
    """Continuous runners: the per-step token budget from this step on (an operator
    changed it live); None: as it was."""
    preempt_seqs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Generating runners: sequences of running requests to free alone (by index in their
    request, as :attr:`Progress.seqs`), as vLLM preempts a child request of ``n > 1``:
    the others run on. Each is reported :class:`Preempted` with ``alone``."""
    resume: tuple[tuple[str, tuple[int, ...], int], ...] = ()
    """Generating runners: sequences freed alone to put back into their running request
    (key, indices, its lane), resumed by recomputation after their last token."""


LOST = "lost"
"""The stop reason of a request this loop no longer answers: another worker took it over,
or the loop failed it while its runner may still run it (:attr:`StepReport.abandoned`).
Not answered, nothing streamed."""


@dataclass(frozen=True, slots=True)
class Final:
    """A request's final outputs (one per input)."""

    key: str
    outputs: list[Any]


@dataclass(slots=True)  # not frozen: one per token and row (4x cheaper to build)
class Partial:
    """A piece of a request's output that can be sent before it finishes (streaming)."""

    key: str
    chunk: Any


@dataclass(frozen=True, slots=True)
class Failed:
    """A request whose computation failed; it is answered ``error`` with ``code``."""

    key: str
    message: str
    code: ErrorCode = ErrorCode.INFERENCE_FAILED


@dataclass(frozen=True, slots=True)
class Preempted:
    """A running request the runner freed, as asked; ``prompts`` are the tokens it will
    prefill per sequence when admitted again, ``max_new_tokens`` what each may still make."""

    key: str
    prompts: tuple[int, ...]
    max_new_tokens: int
    seqs: tuple[int, ...] = ()
    """The index in the request of each sequence of ``prompts`` (empty: not named)."""
    alone: bool = False
    """Only ``seqs`` were freed (:attr:`Work.preempt_seqs`); the request runs on."""
    freed: int | None = None
    """Sequences it took off the device (None: one per prompt): what the ``preemptions``
    counters count, per sequence as vLLM counts its child requests."""

    @property
    def sequences(self) -> int:
        return len(self.prompts) if self.freed is None else self.freed


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a running request of a continuous runner stands after a step (the admission
    policy plans memory with it)."""

    contexts: tuple[int, ...]
    """Tokens in the KV cache per unfinished sequence."""
    prefill_left: tuple[int, ...]
    """Prompt tokens not yet prefilled per unfinished sequence."""
    max_new_tokens_left: int
    seqs: tuple[int, ...] = ()
    """The index in its request of each sequence of ``contexts`` (input ``i``'s ``j``-th
    completion: ``i * n + j``), each preemptable alone; empty: not named (a beam search's
    rounds), the request is preempted whole. A sequence freed alone is in none of them."""


_PROGRESS_FIELDS = ("contexts", "prefill_left", "max_new_tokens_left", "seqs")
if tuple(f.name for f in fields(Progress)) != _PROGRESS_FIELDS:
    raise RuntimeError("Progress's fields changed: update progress() below")
_SET_PROGRESS = tuple(getattr(Progress, name).__set__ for name in _PROGRESS_FIELDS)


def progress(
    contexts: tuple[int, ...],
    prefill_left: tuple[int, ...],
    max_new_tokens_left: int,
    seqs: tuple[int, ...] = (),
) -> Progress:
    """``Progress(...)``, equal to it, at about half its cost: its slots set directly,
    not through the frozen dataclass's ``__init__``. A generating runner makes one per
    running request and step on the device thread, before the loop hears of the step
    (its progress with 64 requests running took about 0.4 ms a step, a third of it here)."""
    p = object.__new__(Progress)
    set_contexts, set_prefill, set_left, set_seqs = _SET_PROGRESS
    set_contexts(p, contexts)
    set_prefill(p, prefill_left)
    set_left(p, max_new_tokens_left)
    set_seqs(p, seqs)
    return p


DONE = progress((), (), 0)
"""The progress of a request whose sequences all ended (shared: it is immutable)."""


StepEvent = Final | Partial | Failed | Preempted


def leaves(ev: StepEvent) -> bool:
    """The event takes its request out of the runner's running ones: its end, or its
    preemption whole (not sequences freed alone: their request runs on)."""
    return isinstance(ev, Final | Failed) or (isinstance(ev, Preempted) and not ev.alone)


@dataclass(slots=True)
class StepReport:
    """What one step did: events per request, and what the engine should learn."""

    events: list[StepEvent] = field(default_factory=list)
    out_of_memory: bool = False
    """Memory ran out at some point (the engine lowers its caps)."""
    calls: int = 1
    """Model calls it took: 1 when clean; more when a batch was bisected or split, and
    then its time says nothing about the batch's cost."""
    progress: dict[str, Progress] = field(default_factory=dict)
    """Continuous runners: each still-running request's state after the step (every one
    it holds but those it preempted: after a step that raised, a request it does not name
    is taken for lost, :mod:`.crashes`)."""
    produced: dict[str, int] | None = None
    """Continuous runners: tokens each request generated in the step (streaming or not).
    None: the runner does not tell; a request's first delta (or result) then marks its
    first token, and no inter-token latency is measured."""
    deferred: Callable[[], None] | None = None
    """Continuous runners: what the runner left to do after the step's deltas are streamed
    (filling ``progress``); :meth:`settle` does it, before the runner steps again."""
    compiling: int = 0
    """Generation: admitted requests waiting for their constraints to compile."""
    compiling_sequences: int = 0
    """Generation: their sequences (each one of vLLM's requests, deferred while its
    constraint compiles)."""
    compiled_s: tuple[float, ...] = ()
    """Generation: the constraints compiled since the last step, how long each took."""
    drafted: tuple[int, int] = (0, 0)
    """Generation with speculative decoding: the rows that proposed drafts in the step,
    and the drafts they proposed."""
    accepted: tuple[int, ...] = ()
    """Generation with speculative decoding: per draft position, the drafts accepted."""
    spec_skipped: int = 0
    """Generation with speculative decoding: rows that proposed no drafts in the step
    because its batch size turned speculation off (:mod:`.generation.spec_bound`)."""
    prefilled: int = 0
    """Generation: prompt tokens computed (not taken from a cache) by the sequences whose
    prefill the step ended (their first token), counted in that step whatever chunks it
    took (vLLM's per-iteration ``prompt_token_stats.computed``)."""
    abandoned: tuple[str, ...] = ()
    """Requests failed in the step without their runner ending them (its hand-off failed, or
    it raised: :mod:`.executor`, :mod:`.crashes`): a continuous runner may still run them,
    so the loop stops them (:data:`LOST`) with its next step, freeing their rows and KV
    blocks."""

    crashed: int = 0
    """The runner raised in this step (its events are the executor's): the how-many-th
    step in a row that did (:mod:`.crashes`); 0: it did not."""

    def settle(self) -> None:
        """Finish the report (``deferred``), once; on the device thread, before the next step."""
        if self.deferred is not None:
            fill, self.deferred = self.deferred, None
            fill()


@runtime_checkable
class Runner(Protocol):
    """What the worker needs from a model. Implement it (or subclass BatchRunner)."""

    name: str
    """Kind of runner, for logs and stats (e.g. ``embedding``)."""
    device: str

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | PrepareError]:
        """CPU side, loop thread: one Prepared (or the PrepareError) per request."""
        ...

    def step(self, work: Work) -> StepReport:
        """Device side: run one step; never raise for a request's fault (report Failed)."""
        ...

    def info(self) -> dict[str, Any]:
        """A few facts for ``inspect stats`` (device, dtype, max tokens...)."""
        ...


def is_continuous(runner: object) -> bool:
    """Does the runner keep requests across steps (a generator), rather than finish each
    in the step that admits it? Such a runner sets ``continuous = True`` and a
    ``generation_policy()`` for the scheduler."""
    return bool(getattr(runner, "continuous", False))


@dataclass(frozen=True, slots=True)
class Encoded:
    """One input text, tokenized and cut to the model's max tokens."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...]
    truncated: bool

    @property
    def tokens(self) -> int:
        return len(self.ids)


class BatchRunner:
    """Base of one-shot runners: every admitted request finishes in its step.

    Subclasses implement ``encode(inputs)`` (tokenize, no padding; decode images...) and
    ``run(rows)`` (one batch, one output per row, msgpack/JSON-able). ``accepts`` names the
    kinds of input it takes (schemas/inputs.py); any other is ``invalid_input``. A ranking
    input makes one row per document; ``assemble`` turns a request's row outputs into its
    outputs (one per input). ``run`` raising
    ``torch.cuda.OutOfMemoryError`` or ``MemoryError`` makes the batch split and the engine
    lower its caps; any other exception is pinned on the request that causes it by
    bisection, so its batch-mates still succeed.
    """

    name = "batch"
    device = "cpu"
    torch_device: Any = None
    accepts: frozenset[Kind] = frozenset({"text"})
    bulk_encode = True
    """Encode every request's inputs in one call (tokenizers batch); False: one request at
    a time (images: a bad one fails only its request, without a second try)."""

    def encode(self, inputs: Sequence[Any]) -> list[Any]:
        """Rows (each with ``tokens`` and ``truncated``) for inputs of the accepted kinds:
        texts only, for a runner that accepts only texts."""
        raise NotImplementedError

    def run(self, rows: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def assemble(self, payload: Sequence[Any], outputs: list[Any]) -> list[Any]:
        """A request's outputs, one per input, from its rows' outputs (default: the same)."""
        return outputs

    def payload(self, request: Request, rows: list[Any]) -> Sequence[Any]:
        """What a request carries to :meth:`assemble` (default: its rows)."""
        return rows

    def info(self) -> dict[str, Any]:
        return {"runner": self.name, "device": self.device}

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | PrepareError]:
        refused = [
            self._refuse(req) if req.generation_fields() else self._refused(req.inputs)
            for req in requests
        ]
        takes = [req for req, bad in zip(requests, refused, strict=True) if bad is None]
        inputs = [t for req in takes for t in req.inputs]
        encoded: list[Any] | None = None
        if self.bulk_encode and takes:
            try:  # one call for all: fast tokenizers batch (and parallelise) it
                encoded = self.encode(inputs)
                if len(encoded) != _row_count(inputs):
                    raise RuntimeError(f"encode returned {len(encoded)} rows")
            except Exception:
                encoded = None
        out: list[Prepared | PrepareError] = []
        pos = 0
        for req, bad in zip(requests, refused, strict=True):
            if bad is not None:
                out.append(bad)
            elif encoded is None:
                out.append(self._prepare_one(req))
            else:
                n = _row_count(req.inputs)
                out.append(self._prepared(req, encoded[pos : pos + n]))
                pos += n
        return out

    def _refuse(self, request: Request) -> PrepareError:
        fields = ", ".join(request.generation_fields())
        return PrepareError(f"a {self.name} model does not generate text: {fields} not supported")

    def _refused(self, inputs: Sequence[AnyInput]) -> PrepareError | None:
        for i, item in enumerate(inputs):
            if type(item) is str and "text" in self.accepts:
                continue
            kind = kind_of(item)
            if kind not in self.accepts:
                takes = ", ".join(sorted(self.accepts))
                return InvalidInput(
                    f"inputs[{i}] is of kind {kind}: the {self.name} runner takes {takes}"
                )
        return None

    def _prepare_one(self, request: Request) -> Prepared | PrepareError:
        try:
            rows = self.encode(request.inputs)
        except PrepareError as exc:
            return exc
        except Exception as exc:
            what = "prepare" if "image" in self.accepts else "tokenize"
            return PrepareError(f"cannot {what}: {type(exc).__name__}: {exc}")
        return self._prepared(request, rows)

    def _prepared(self, request: Request, rows: list[Any]) -> Prepared:
        payload = self.payload(request, rows)
        if len(rows) == 1:  # the common case, on the hot path
            row = rows[0]
            return Prepared(payload, 1, row.tokens, (row.truncated,), input_tokens=row.tokens)
        counts = [r.tokens for r in rows]
        return Prepared(
            payload=payload,
            rows=len(rows),
            tokens=max(counts, default=0),
            truncated=_truncated(request.inputs, rows),
            input_tokens=sum(counts),
        )

    def step(self, work: Work) -> StepReport:
        report = StepReport(calls=0)
        groups = [(key, prep.payload) for key, prep in work.admit]
        payloads = dict(groups)
        report.events = [
            Final(ev.key, self.assemble(payloads[ev.key], ev.outputs))
            if isinstance(ev, Final)
            else ev
            for ev in self._run(groups, report)
        ]
        return report

    def _run(self, groups: list[tuple[str, Sequence[Any]]], acc: StepReport) -> list[StepEvent]:
        rows = [row for _, g in groups for row in g]
        acc.calls += 1
        failure: _Failure | None
        try:
            flat = self.run(rows)
            if len(flat) != len(rows):
                raise RuntimeError(f"runner returned {len(flat)} outputs for {len(rows)} rows")
        except Exception as exc:
            failure = _Failure.of(exc)
        else:
            failure = None
        if failure is not None:
            # retried out here: inside the except clause the failed call's tensors (its
            # frames, held by the traceback) would still take the device's memory
            return self._split(groups, rows, failure, acc)
        out: list[StepEvent] = []
        i = 0
        for key, g in groups:
            out.append(Final(key, list(flat[i : i + len(g)])))
            i += len(g)
        return out

    def _split(
        self,
        groups: list[tuple[str, Sequence[Any]]],
        rows: list[Any],
        failure: _Failure,
        acc: StepReport,
    ) -> list[StepEvent]:
        """Retry halves: by request while there are several, by rows on out-of-memory."""
        oom = failure.out_of_memory
        if oom:
            acc.out_of_memory = True
            if self.torch_device is not None:
                from .device import release_cached_memory  # torch only on this error path

                release_cached_memory(self.torch_device)
        if len(groups) > 1:
            mid = len(groups) // 2
            return self._run(groups[:mid], acc) + self._run(groups[mid:], acc)
        (key, _), message = groups[0], failure.message
        if oom and len(rows) > 1:
            mid = len(rows) // 2
            halves = [
                self._run([(key, rows[:mid])], acc)[0],
                self._run([(key, rows[mid:])], acc)[0],
            ]
            failed = next((h for h in halves if isinstance(h, Failed)), None)
            if failed is not None:
                return [failed]
            assert isinstance(halves[0], Final) and isinstance(halves[1], Final)
            return [Final(key, halves[0].outputs + halves[1].outputs)]
        logger.warning("request %s failed in inference: %s", key, message)
        return [Failed(key, message)]


@dataclass(frozen=True, slots=True)
class _Failure:
    """What a failed batch call leaves for its retries: no exception, no traceback."""

    message: str
    out_of_memory: bool

    @classmethod
    def of(cls, exc: Exception) -> _Failure:
        # torch only on this error path: the worker app (and what imports it to send
        # control commands or run webhooks) stays light
        from .device import is_out_of_memory

        return cls(f"{type(exc).__name__}: {exc}", is_out_of_memory(exc))


def _row_count(inputs: Sequence[AnyInput]) -> int:
    """Rows inputs take: one each, a ranking one per document."""
    return sum(len(i.documents) if isinstance(i, Ranking) else 1 for i in inputs)


def _truncated(inputs: Sequence[AnyInput], rows: Sequence[Any]) -> tuple[bool, ...]:
    """Per input: was any of its rows cut to the model's limit?"""
    out: list[bool] = []
    pos = 0
    for item in inputs:
        n = len(item.documents) if isinstance(item, Ranking) else 1
        out.append(any(r.truncated for r in rows[pos : pos + n]))
        pos += n
    return tuple(out)
