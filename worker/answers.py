"""Turning the scheduler's decisions into results on the wire (timings included).

The loop decides *what* happens to a request; this module builds the ``Result`` and the
:class:`~.streams.Finish` that the sink stores. Nothing here touches Redis.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..batching.types import Waiting
from ..config import ModelConfig
from ..schemas.codec import EntryRejected, encode_result
from ..schemas.errors import ErrorCode
from ..schemas.messages import (
    ErrorInfo,
    Format,
    PromptTokensDetails,
    Request,
    Result,
    Status,
    Timings,
    Usage,
)
from .observers import Reply
from .runner import Prepared
from .streams import Entry, Finish
from .token_stream import TokenWrite

logger = logging.getLogger(__name__)

EXPIRED = ErrorInfo(
    code=ErrorCode.DEADLINE_EXCEEDED, message="deadline cannot be met; not computed"
)


@dataclass(slots=True)
class Held:
    """A valid request a worker has read and not yet answered."""

    entry: Entry
    request: Request
    fmt: Format
    prepared: Prepared
    waiting: Waiting
    read_at: float


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One result to store, publish and ack. It is encoded by whoever stores it (the sink's
    writer thread), so encoding runs beside the loop rather than on it."""

    entry: Entry
    request: Request | None
    """None when the entry could not be decoded into a request."""
    result: Result
    fmt: Format
    ttl_s: int
    reply_to: str | None
    fenced: bool = False
    """A generation's attempt (see :class:`~.streams.Finish`)."""
    end: TokenWrite | None = None
    """Its token stream's end, written with the result."""

    def encode(self) -> tuple[Finish, Reply]:
        """The bytes to store, and what observers hear once they are stored."""
        result = self.result
        try:
            payload = encode_result(result, self.fmt)
        except Exception as exc:  # a runner returned outputs the wire cannot carry
            logger.warning("result of %s cannot be encoded: %s", result.id, exc)
            message = f"runner output cannot be encoded: {type(exc).__name__}: {exc}"
            error = ErrorInfo(code=ErrorCode.INFERENCE_FAILED, message=message)
            result = result.model_copy(update={"status": "error", "outputs": None,
                                               "truncated": None, "error": error})  # fmt: skip
            payload = encode_result(result, self.fmt)
        finish = Finish(self.entry, result.id, payload, self.ttl_s, self.reply_to, self.fenced,
                        self.end)  # fmt: skip
        return finish, Reply(self.entry.lane, self.request, result, True)


@dataclass(frozen=True, slots=True)
class BatchRun:
    """Where a computed batch's time went, for its members' timings."""

    batch_id: str
    rows: int
    started_at: float
    finished_at: float


class Answerer:
    """Builds one model's results as one consumer (worker)."""

    def __init__(self, model: str, config: ModelConfig, consumer: str) -> None:
        self.model = model
        self.config = config
        self.consumer = consumer

    def computed(self, run: BatchRun, held: Held, outputs: list[Any], now: float) -> Outgoing:
        """An ``ok`` result of a finished batch, with the tokens it took as its usage."""
        timings = self._batch_timings(run, held, now)
        req = held.request
        prepared = held.prepared
        truncated = list(prepared.truncated) if prepared.truncated is not None else None
        usage = Usage.model_construct(prompt_tokens=prepared.input_tokens)
        result = self.result(req.id, "ok", req.metadata, timings, now, outputs=outputs,
                             truncated=truncated, usage=usage)  # fmt: skip
        return self._answer(held, result)

    def generated(
        self, run: BatchRun, held: Held, outputs: list[Any], first_token_at: float | None,
        now: float,
    ) -> Outgoing:  # fmt: skip
        """An ``ok`` result of a generation (``outputs``: Generation maps), with its usage
        and time to first token. ``run`` spans its first step's start to its last's end."""
        first: dict[str, float] = {}  # (set only if known, as a copy updated with it did)
        if first_token_at is not None:
            enq = held.entry.enqueued_ms / 1000
            first["first_token_ms"] = round(max(0.0, first_token_at - enq) * 1000, 3)
        timings = self._batch_timings(run, held, now, **first)
        n = held.request.n or 1  # each prompt counts once, whatever its completions
        cached = sum(int(o.get("cached_tokens", 0)) for o in outputs[::n])
        usage = Usage.model_construct(
            prompt_tokens=sum(int(o.get("prompt_tokens", 0)) for o in outputs[::n]),
            completion_tokens=sum(int(o.get("completion_tokens", 0)) for o in outputs),
            prompt_tokens_details=PromptTokensDetails.model_construct(cached_tokens=cached),
        )
        req = held.request
        result = self.result(req.id, "ok", req.metadata, timings, now, outputs=outputs,
                             usage=usage)  # fmt: skip
        return self._answer(held, result)

    def cancelled(self, held: Held, now: float) -> Outgoing:
        """A generation request cancelled before it started: ``ok``, nothing generated. As
        vLLM's aborted request, each output has the empty ``token_ids`` and ``logprobs``
        its request asked for (a client reads a list, not a missing key), and counts its
        prompt's tokens (so does the usage); the first output of each input carries, as
        asked, its ``prompt_token_ids`` and ``prompt_text``, as a result that ran would."""
        req = held.request
        spec = held.prepared.payload  # a generating runner's: its prompts as token ids
        prompts = _prompt_ids(getattr(spec, "prompts", ()))
        texts: tuple[str, ...] | None = getattr(spec, "prompt_texts", None)
        n = req.n or 1
        outputs: list[dict[str, Any]] = []
        for k in range(req.output_count):
            i, first = k // n, k % n == 0
            prompt = prompts[i] if i < len(prompts) else ()
            out: dict[str, Any] = {"text": "", "finish_reason": "cancelled",
                                   "prompt_tokens": len(prompt), "completion_tokens": 0}  # fmt: skip
            if req.return_token_ids:
                out["token_ids"] = []
                if first:
                    out["prompt_token_ids"] = list(prompt)
            if texts is not None and first and i < len(texts):
                out["prompt_text"] = texts[i]
            if req.logprobs is not None:
                out["logprobs"] = []
            outputs.append(out)
        run = BatchRun("", 0, now, now)
        return self.generated(run, held, outputs, None, now)

    def failed(
        self, run: BatchRun, held: Held, code: ErrorCode, message: str, now: float
    ) -> Outgoing:
        """An ``error`` result for a request whose computation failed."""
        timings = self._batch_timings(run, held, now)
        error = ErrorInfo(code=code, message=message)
        req = held.request
        return self._answer(
            held, self.result(req.id, "error", req.metadata, timings, now, error=error)
        )

    def expired(self, held: Held, now: float) -> Outgoing:
        """``expired``: its deadline cannot be met, so it is never computed."""
        timings = self.timings(held.entry, held.read_at, now, now)
        req = held.request
        return self._answer(
            held, self.result(req.id, "expired", req.metadata, timings, now, error=EXPIRED)
        )

    def refused(self, held: Held, message: str, now: float) -> Outgoing:
        """``invalid_request``: it can never run here (``message`` says why): never computed."""
        timings = self.timings(held.entry, held.read_at, now, now)
        req = held.request
        error = ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=message[:1000])
        return self._answer(
            held, self.result(req.id, "error", req.metadata, timings, now, error=error)
        )

    def error(
        self, entry: Entry, request: Request, fmt: Format, code: ErrorCode, message: str, now: float
    ) -> Outgoing:
        """An ``error`` result for a valid request that cannot be computed."""
        result = self.result(request.id, "error", request.metadata,
                             self.timings(entry, now, now, now), now,
                             error=ErrorInfo(code=code, message=message))  # fmt: skip
        return self._outgoing(entry, request, fmt, result)

    def rejected(self, entry: Entry, exc: EntryRejected, now: float) -> Outgoing | None:
        """The error result of an entry that will not be computed (None: no readable id)."""
        env = exc.envelope
        if env.id is None:
            return None
        logger.info("request %s of %s rejected: %s", env.id, self.model, exc)
        result = self.result(env.id, "error", env.metadata, self.timings(entry, now, now, now), now,
                             error=ErrorInfo(code=exc.code, message=str(exc)))  # fmt: skip
        return Outgoing(entry, None, result, env.format, self.config.result_ttl_s, env.reply)

    def result(
        self,
        request_id: str,
        status: Status,
        metadata: dict[str, str],
        timings: Timings,
        now: float,
        **rest: Any,
    ) -> Result:
        # Every field is built here from checked values: skip validation (hot path).
        return Result.model_construct(
            id=request_id, model=self.model, status=status, metadata=metadata, timings=timings,
            finished_at_ms=int(now * 1000), **rest,
        )  # fmt: skip

    def _answer(self, held: Held, result: Result) -> Outgoing:
        return self._outgoing(held.entry, held.request, held.fmt, result)

    def _outgoing(self, entry: Entry, request: Request, fmt: Format, result: Result) -> Outgoing:
        ttl = min(
            request.result_ttl_s or self.config.result_ttl_s, self.config.limits.max_result_ttl_s
        )
        return Outgoing(entry, request, result, fmt, ttl, request.reply)

    def _batch_timings(self, run: BatchRun, held: Held, now: float, **more: Any) -> Timings:
        run_ms = (run.finished_at - run.started_at) * 1000
        return self.timings(held.entry, held.read_at, run.started_at, now, run_ms, run.rows,
                            run.batch_id, **more)  # fmt: skip

    def timings(
        self,
        entry: Entry,
        read_at: float,
        started_at: float,
        now: float,
        run_ms: float = 0.0,
        rows: int = 0,
        batch_id: str = "",
        **more: Any,
    ) -> Timings:
        """Milliseconds on the Redis clock: enqueue (the entry id's time) → read → start → now
        (``more``: other fields, such as a generation's ``first_token_ms``)."""
        enq = entry.enqueued_ms / 1000
        return Timings.model_construct(  # checked values (hot path)
            queued_ms=round(max(0.0, read_at - enq) * 1000, 3),
            batch_wait_ms=round(max(0.0, started_at - read_at) * 1000, 3),
            inference_ms=round(run_ms, 3),
            total_ms=round(max(0.0, now - enq) * 1000, 3),
            batch_size=rows,
            batch_id=batch_id,
            worker=self.consumer,
            **more,
        )


def waiting_of(entry: Entry, request: Request, prepared: Prepared) -> Waiting:
    """What the batching engine sees of a request."""
    enq = entry.enqueued_ms / 1000
    deadline = None if request.deadline_ms is None else enq + request.deadline_ms / 1000
    return Waiting(
        key=entry.key,
        lane=entry.lane,
        arrived=enq,
        tokens=prepared.tokens,
        size=prepared.rows,
        deadline=deadline,
    )


def dead_reason(entry: Entry, max_deliveries: int) -> str:
    return (
        f"delivered {entry.deliveries} times without an answer (max_deliveries "
        f"{max_deliveries}): it keeps failing or crashing workers"
    )


def _prompt_ids(prompts: Any) -> tuple[tuple[int, ...], ...]:
    """A runner payload's ``prompts`` as token ids per input: empty unless it holds them
    (another runner's payload may name something else so, e.g. prompt lengths)."""
    if not isinstance(prompts, tuple | list):
        return ()
    if not all(isinstance(p, tuple | list) for p in prompts):
        return ()
    return tuple(tuple(p) for p in prompts)
