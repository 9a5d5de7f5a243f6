"""The producer's logic, written once for both producers: a sans-I/O core.

Each operation (submit, wait, results) is a generator that yields the Redis operations it
needs (producer/ops.py: :class:`Get`, :class:`RunScript`, :class:`Listen`, ...) and receives
their replies; a connection error is thrown back into it at the ``yield``. The retry and backoff policy,
request building, result decoding, resubscription and sweeps live here alone;
:class:`~batchfleet.producer.Producer` and :class:`~batchfleet.producer.AsyncProducer` are
thin shells that carry out the operations with a sync or an asyncio client.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar

from typing_extensions import Unpack

from ..schemas.codec import decode_reply, decode_result
from ..schemas.errors import JobFailed, NotStreamed, ResultTimeout, Unavailable
from ..schemas.keys import ModelKeys, default_reply_channel
from ..schemas.messages import DEFAULT_LIMITS, Format, Limits, Request, Result, StructuredOutputs
from .ops import (
    DOWN,
    Emit,
    Get,
    GetMany,
    Listen,
    Op,
    RunScript,
    SetEx,
    Sleep,
    Steps,
    Subscribe,
    Unsubscribe,
)
from .submit import (
    Chat,
    InputsArg,
    LaneCache,
    WebhookArg,
    build_request,
    gather_inputs,
    is_chat,
    prepare,
    queue_full,
    split_accepted,
    unavailable,
)
from .tokens import Follower, read_tokens

logger = logging.getLogger(__name__)
J = TypeVar("J")

PIPELINE_CHUNK = 1000
SWEEP_S = 2.0
"""A reply-channel listener re-reads stored results after this long without a message."""
DEFAULT_RETRY_FOR_S = 10.0
"""How long ``submit`` retries connection errors before raising ``Unavailable`` (issue #15: a
2-second Redis restart must not reach callers)."""
RETRY_FIRST_PAUSE_S = 0.05
RETRY_MAX_PAUSE_S = 1.0
RECONNECT_PAUSE_S = 0.2
"""Pause before polling or resubscribing again while Redis is unreachable."""


class CoreOptions(TypedDict, total=False):
    """Keyword options of both producers' constructors."""

    limits: Limits
    """Bounds checked before a request is sent (the workers' defaults)."""
    wire_format: Format
    """Encoding of requests: ``msgpack`` (default) or ``json``."""
    default_priority: int
    """The lane of a request submitted without ``priority`` (default 1)."""
    retry_for_s: float
    """How long connection errors are retried with backoff (default 10 s)."""
    sweep_s: float
    """A reply-channel listener re-reads stored results after this long without a message."""


class GenerationOptions(TypedDict, total=False):
    """Options of a request to a ``text-generation`` model (an encoder model answers
    ``invalid_request`` if any is set). None: the model's default."""

    max_new_tokens: int | None
    """Tokens to generate at most, per input (bounded by the model). 0: none, the prompt
    only (its ``prompt_tokens``, and as asked ``prompt_token_ids``, ``prompt_logprobs``,
    ``prompt_text``); workers older than it answer ``invalid_request``."""
    temperature: float | None
    """0 (the default) decodes greedily; above 0 it samples."""
    top_p: float | None
    top_k: int | None
    min_p: float | None
    """Sample only tokens at least this fraction as likely as the likeliest (vLLM's)."""
    seed: int | None
    """Sampling seed: the same request and seed give the same text."""
    stop: str | Sequence[str] | None
    """Generation ends before the first of these strings (``finish_reason`` ``stop``)."""
    stream: bool | None
    """Have the worker stream the text as it is produced: needed for ``job.stream()`` and
    ``job.deltas()``."""
    repetition_penalty: float | None
    """Above 1, tokens already in the prompt or output are less likely (HF, vLLM)."""
    presence_penalty: float | None
    """-2 to 2: taken off the logit of every token the output holds (OpenAI)."""
    frequency_penalty: float | None
    """-2 to 2: taken off a token's logit per time the output holds it (OpenAI)."""
    min_new_tokens: int | None
    """No end-of-sequence before this many tokens."""
    thinking_token_budget: int | None
    """Reasoning tokens allowed per output, then the end of reasoning is forced (vLLM's;
    a model with reasoning markers); workers older than it answer ``invalid_request``."""
    logprobs: int | None
    """0-20: each output carries its tokens' log-probabilities and this many alternatives'."""
    stop_token_ids: Sequence[int] | None
    """Generation ends once one of these tokens is generated (it stays in the output)."""
    logit_bias: Mapping[int, float] | None
    """Token id -> -100 … 100, added to its logit before sampling (OpenAI's)."""
    n: int | None
    """1-16 completions per input: the outputs hold ``n`` per input, input by input."""
    ignore_eos: bool | None
    """Generate past end-of-sequence tokens, up to ``max_new_tokens`` (vLLM's)."""
    include_stop_str_in_output: bool | None
    """A text ended by a stop string keeps it (vLLM's)."""
    truncate_prompt_tokens: int | None
    """Keep only each prompt's last this many tokens (vLLM's)."""
    prompt_logprobs: int | None
    """Each prompt token's log-probability and this many likeliest tokens' (vLLM's)."""
    structured_outputs: StructuredOutputs | Mapping[str, Any] | None
    """The text follows one constraint (vLLM's): ``{"json": schema}`` (a JSON Schema, or
    a pydantic model class), ``{"json_object": True}``, ``{"regex": ...}``,
    ``{"choice": [...]}`` or ``{"grammar": ...}`` (Lark or GBNF)."""
    response_format: Mapping[str, Any] | None
    """OpenAI's: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}``; not with ``structured_outputs``."""
    tools: Sequence[Mapping[str, Any]] | None
    """OpenAI's, with ``messages``: ``[{"type": "function", "function": {"name", "description",
    "parameters"}}]`` (``parameters``: a JSON Schema, or a pydantic model class); each output's
    ``tool_calls`` holds the calls it makes."""
    tool_choice: str | Mapping[str, Any] | None
    """``"auto"`` (the default with tools; the model's ``tool_call_parser`` reads the calls),
    ``"required"``, ``{"type": "function", "function": {"name": ...}}`` or ``"none"``."""
    parallel_tool_calls: bool | None
    """False: at most one tool call per output (OpenAI's)."""
    allowed_token_ids: Sequence[int] | None
    """Only these tokens are generated (vLLM's; list an end-of-sequence token to end)."""
    skip_special_tokens: bool | None
    """False: special tokens' text stays in the output (vLLM's)."""
    bad_words: Sequence[str] | None
    """Words never generated (vLLM's)."""
    chat_template_kwargs: Mapping[str, Any] | None
    """More variables for the chat template, e.g. ``{"enable_thinking": False}`` (vLLM's)."""
    chat_template: str | None
    """A Jinja chat template for this chat in place of the model's (vLLM's); only a model
    with ``trust_request_chat_template`` takes it, others answer ``invalid_request``."""
    add_generation_prompt: bool | None
    """False: the template does not open the assistant's turn (vLLM's)."""
    continue_final_message: bool | None
    """The last (assistant) message is continued, not closed (vLLM's)."""
    return_token_ids: bool | None
    """Outputs carry ``token_ids`` (and ``prompt_token_ids``), deltas theirs (vLLM's)."""
    return_prompt_text: bool | None
    """Each input's first output carries ``prompt_text``: its prompt as the model read it
    (a chat's rendered template, token ids decoded)."""
    add_special_tokens: bool | None
    """Whether the tokenizer adds its special tokens to a prompt (default: a text's yes, a
    chat's no; vLLM's); workers older than it answer ``invalid_request``."""
    return_token_strs: bool | None
    """Each input's first output carries ``prompt_token_strs``: its prompt's tokens as the
    tokenizer writes them (vLLM's ``/tokenize``); workers older than it answer
    ``invalid_request``."""
    cache_salt: str | None
    """Cached prefixes are shared only with requests of the same salt (vLLM's)."""
    reasoning_effort: str | None
    """``"low"``, ``"medium"`` or ``"high"``, for the chat template (OpenAI's; gpt-oss)."""
    lora: str | None
    """The model's LoRA adapter (a name of its info's ``lora_adapters``) the text comes
    from; none: the base model (vLLM's multi-LoRA)."""
    use_beam_search: bool | None
    """Beam search, ``n`` its width: each input's ``n`` best beams (vLLM's; not streamed)."""
    length_penalty: float | None
    """With ``use_beam_search``: beams ranked by log-probability over length to this power."""


GENERATION_OPTIONS = tuple(GenerationOptions.__annotations__)


class ManyOptions(GenerationOptions, total=False):
    """Keyword options of ``submit_many`` (and of ``submit``)."""

    priority: int | None
    """The lane, 0 = highest; default: the producer's ``default_priority``."""
    deadline_ms: int | None
    metadata: Mapping[str, str] | None
    result_format: Format | None
    webhook: WebhookArg
    """``"https://..."`` or ``{"url": ..., "secret_id": ..., "format": ...}``: also POST the
    result there, signed; it stays pollable either way."""


class InputOptions(TypedDict, total=False):
    """Inputs other than texts, as keywords of ``submit`` (added after ``inputs``)."""

    images: Iterable[bytes] | None
    """Encoded images (PNG, JPEG, WebP...), one input each."""
    pairs: Iterable[tuple[str, str]] | None
    """``(text, text_pair)`` tuples: a reranker's (query, document), NLI's two texts."""
    query: str | None
    """With ``documents``: one ranking input, answered with the documents best first."""
    documents: Iterable[str] | None
    top_n: int | None
    """Of a ranking: how many of the best documents to return (default all)."""


class SubmitOptions(ManyOptions, InputOptions, total=False):
    """Keyword options of ``submit``."""

    messages: Chat | None
    """A chat for a generation model, instead of ``inputs``: one output."""

    result_ttl_s: int | None
    request_id: str | None
    """Your id for the request (default: a new UUID); resubmit with the same id after
    :class:`Unavailable` names it among ``unknown_ids``."""


@dataclass(frozen=True, slots=True)
class JobRef:
    """A submitted request: its id and model; for a generation request, whether its tokens
    are streamed and how many inputs (outputs) it has."""

    id: str
    model: str
    streaming: bool = field(default=False, kw_only=True)
    """Submitted with ``stream=True``: ``stream()`` and ``deltas()`` read its token stream."""
    input_count: int = field(default=1, kw_only=True)
    output_count: int = field(default=1, kw_only=True)
    """Its outputs: one per input, or ``n`` per input."""

    @classmethod
    def of(cls, request: Request, **more: Any) -> Any:
        return cls(
            request.id,
            request.model,
            streaming=bool(request.stream),
            input_count=request.input_count,
            output_count=request.output_count,
            **more,
        )

    @property
    def result_key(self) -> str:
        return ModelKeys(self.model).result(self.id)

    @property
    def webhook_key(self) -> str:
        """Where webhooks workers record its webhook delivery (docs/protocol.md#webhooks)."""
        return ModelKeys(self.model).webhook_status(self.id)

    def check_streaming(self, one_input: bool) -> None:
        """Raise unless its token stream can be read (by ``stream()`` if ``one_input``)."""
        if not self.streaming:
            raise NotStreamed(
                f"request {self.id} was submitted without stream=True: no token stream is "
                "written for it (job.result() has its text)"
            )
        if one_input and self.output_count != 1:
            raise ValueError(
                f"request {self.id} has {self.output_count} outputs ({self.input_count} inputs):"
                " job.stream() reads one; use job.deltas()"
            )


def generation_texts(result: Result) -> list[str]:
    """The generated texts of an ``ok`` result (:class:`JobFailed` for another status)."""
    return [g.text for g in raise_for_status(result).generations()]


def raise_for_status(result: Result) -> Result:
    """``result`` if it is ``ok``; else :class:`JobFailed` (any other status, known or not)."""
    if not result.ok:
        err = result.error
        raise JobFailed(
            f"request {result.id} {result.status}: {err.message if err else ''}",
            err.code if err else "internal",
            result,
        )
    return result


class RetryBudget:
    """Retries of connection errors with exponential backoff, for ``retry_for_s`` counted
    from the first failure."""

    def __init__(self, retry_for_s: float) -> None:
        self.retry_for_s = retry_for_s
        self.deadline: float | None = None
        self.pause = RETRY_FIRST_PAUSE_S

    def next_pause(self) -> float | None:
        """Seconds to wait before the next try, or None once the budget is spent."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.retry_for_s
        left = self.deadline - now
        if left <= 0:
            return None
        pause = min(self.pause, left)
        self.pause = min(self.pause * 2, RETRY_MAX_PAUSE_S)
        return pause


class ProducerCore(Generic[J]):
    """Everything a producer does, as :data:`Steps`; ``make_job(request)`` builds the
    shell's job objects."""

    def __init__(
        self, url: str, make_job: Callable[[Request], J], **options: Unpack[CoreOptions]
    ) -> None:
        self.url = url
        self.make_job = make_job
        self.limits = options.get("limits", DEFAULT_LIMITS)
        self.wire_format: Format = options.get("wire_format", "msgpack")
        self.default_priority = options.get("default_priority", 1)
        self.retry_for_s = options.get("retry_for_s", DEFAULT_RETRY_FOR_S)
        self.sweep_s = options.get("sweep_s", SWEEP_S)
        self.client_id = uuid.uuid4().hex
        self.reply_channel = default_reply_channel(self.client_id)
        self.lane_cache = LaneCache()

    # --- submitting ---------------------------------------------------------------------------

    def _retrying(self, op: Op, budget: RetryBudget, unknown: Sequence[str] = ()) -> Steps[Any]:
        """``op``, tried again on connection errors until ``budget`` is spent; then
        :class:`Unavailable` naming ``unknown``, the requests ``op`` may have added."""
        while True:
            try:
                return (yield op)
            except DOWN as exc:
                pause = budget.next_pause()
                if pause is None:
                    raise unavailable(self.url, exc, unknown) from exc
                logger.warning(
                    "Redis unreachable (%s); retrying in %.2fs (requests %s)",
                    exc,
                    pause,
                    ", ".join(unknown[:5]) or "-",
                )
                yield Sleep(pause)

    def lanes(self, model: str, budget: RetryBudget | None = None) -> Steps[int]:
        """The model's lane count (``bf:{model}:lanes``, cached briefly)."""
        cached = self.lane_cache.get(model)
        if cached is not None:
            return cached
        raw = yield from self._retrying(
            Get(ModelKeys(model).lanes_key), budget or RetryBudget(self.retry_for_s)
        )
        return self.lane_cache.put(model, raw)

    def _build(
        self,
        model: str,
        inputs: InputsArg,
        options: ManyOptions,
        request_id: str | None = None,
        result_ttl_s: int | None = None,
        messages: Chat | None = None,
    ) -> tuple[Request, int]:
        """A validated request (its id fixed here, once) and its lane: checked before Redis."""
        request = build_request(
            model,
            inputs,
            messages=messages,
            generation={k: options.get(k) for k in GENERATION_OPTIONS},
            limits=self.limits,
            request_id=request_id,
            deadline_ms=options.get("deadline_ms"),
            reply=self.reply_channel,
            result_ttl_s=result_ttl_s,
            metadata=options.get("metadata"),
            result_format=options.get("result_format"),
            webhook=options.get("webhook"),
        )
        priority = options.get("priority")
        return request, self.default_priority if priority is None else priority

    def submit(self, model: str, inputs: InputsArg, options: SubmitOptions) -> Steps[J]:
        """One request. Its id is fixed before the first try, so a retry after an unknown
        outcome adds an entry with the same id, which gets the same single result."""
        given = gather_inputs(
            inputs,
            images=options.get("images"),
            pairs=options.get("pairs"),
            query=options.get("query"),
            documents=options.get("documents"),
            top_n=options.get("top_n"),
        )
        request, lane = self._build(
            model, given, options, options.get("request_id"), options.get("result_ttl_s"),
            options.get("messages"),
        )  # fmt: skip
        budget = RetryBudget(self.retry_for_s)
        p = prepare(request, lane, (yield from self.lanes(model, budget)), self.wire_format)
        (reply,) = yield from self._retrying(RunScript([(p.keys, p.args)]), budget, [request.id])
        if isinstance(reply, Exception):
            raise (queue_full(reply) or reply) from None
        return self.make_job(request)

    def submit_many(
        self, model: str, requests: Iterable[InputsArg | Chat], options: ManyOptions
    ) -> Steps[list[J]]:
        """Many requests, pipelined in chunks; each chunk retried like :meth:`submit`. Each
        is a text, a list of texts, or a chat (a list of messages).

        :class:`QueueFull` and :class:`Unavailable` carry ``accepted``: the jobs that did go
        in; ``Unavailable.unknown_ids`` names the requests that may or may not have.
        """
        built = [
            self._build(model, None, options, messages=item)  # type: ignore[arg-type]
            if is_chat(item)
            else self._build(model, item, options)
            for item in requests
        ]
        budget = RetryBudget(self.retry_for_s)
        lanes = yield from self.lanes(model, budget)
        prepared = [prepare(request, lane, lanes, self.wire_format) for request, lane in built]
        jobs: list[J] = []
        for start in range(0, len(prepared), PIPELINE_CHUNK):
            chunk = prepared[start : start + PIPELINE_CHUNK]
            if start:
                budget = RetryBudget(self.retry_for_s)  # each chunk may ride out an outage
            try:
                replies = yield from self._retrying(
                    RunScript([(p.keys, p.args) for p in chunk]),
                    budget,
                    [p.request.id for p in chunk],
                )
            except Unavailable as exc:
                exc.accepted = jobs
                raise
            went_in, full = split_accepted(chunk, replies)
            jobs += [self.make_job(p.request) for p in went_in]
            if full is not None:
                full.accepted = jobs
                raise full
        return jobs

    # --- results ------------------------------------------------------------------------------

    def peek(self, model: str, request_id: str) -> Steps[Result | None]:
        raw = yield Get(ModelKeys(model).result(request_id))
        return None if raw is None else decode_result(raw)

    def wait(self, model: str, request_id: str, timeout: float | None) -> Steps[Result]:
        """Poll the result key, backing off from 1 ms to 25 ms; through a Redis outage it keeps
        trying until ``timeout``, then raises :class:`Unavailable` if Redis is still away."""
        key = ModelKeys(model).result(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        down: Exception | None = None
        while True:
            try:
                raw = yield Get(key)
                down = None
            except DOWN as exc:
                if down is None:
                    logger.warning("Redis unreachable waiting for %s (%s); retrying", key, exc)
                raw, down = None, exc
            if raw is not None:
                return decode_result(raw)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                if down is not None:
                    raise unavailable(self.url, down)
                raise ResultTimeout(f"no result for {request_id} within {timeout}s")
            step = pause if down is None else RECONNECT_PAUSE_S
            yield Sleep(step if left is None else min(step, left))
            pause = min(pause * 1.5, 0.025)

    def results(self, jobs: Mapping[str, str], timeout: float | None) -> Generator[Op, Any, None]:
        """Yield :class:`Emit` for each result of ``jobs`` (request id → model) as it arrives
        on the reply channel.

        Subscribes first, then reads the stored results, so none is missed. Pub/sub is
        fire-and-forget, so after a reconnect (it resubscribes) or ``sweep_s`` without a
        message it reads the stored results again. Messages that are not results are skipped.
        Raises :class:`ResultTimeout` if some are still missing after ``timeout``.
        """
        waiting = {rid: ModelKeys(model).result(rid) for rid, model in jobs.items()}
        deadline = None if timeout is None else time.monotonic() + timeout
        subscribed = False
        swept = time.monotonic()
        while waiting:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ResultTimeout(f"{len(waiting)} results missing after {timeout}s")
            try:
                if not subscribed:
                    yield Subscribe(self.reply_channel)
                    subscribed = True
                    yield from self._sweep(waiting)
                    swept = time.monotonic()
                    continue
                data = yield Listen(0.5 if left is None else min(0.5, left))
                result = None if data is None else decode_reply(data)
                if result is not None and waiting.pop(result.id, None) is not None:
                    yield Emit(result)
                elif data is None and time.monotonic() - swept >= self.sweep_s:
                    yield from self._sweep(waiting)
                    swept = time.monotonic()
            except DOWN as exc:
                logger.warning("Redis unreachable listening on %s (%s)", self.reply_channel, exc)
                subscribed = False
                yield Unsubscribe()
                yield Sleep(RECONNECT_PAUSE_S if left is None else min(RECONNECT_PAUSE_S, left))

    def _sweep(self, waiting: dict[str, str]) -> Generator[Op, Any, None]:
        """Emit the stored results among ``waiting`` (request id → result key)."""
        ids = list(waiting)
        for start in range(0, len(ids), PIPELINE_CHUNK):
            chunk = ids[start : start + PIPELINE_CHUNK]
            raws = yield GetMany([waiting[rid] for rid in chunk])
            for rid, raw in zip(chunk, raws, strict=True):
                if raw is not None:
                    del waiting[rid]
                    yield Emit(decode_result(raw))

    # --- generation -----------------------------------------------------------------------------

    def tokens(
        self, model: str, request_id: str, timeout: float | None, follower: Follower
    ) -> Steps[None]:
        """Follow the request's token stream (producer/tokens.py), emitting what ``follower``
        makes of its deltas."""
        return (yield from read_tokens(self.url, model, request_id, timeout, follower))

    def cancel(self, model: str, request_id: str, ttl_s: int) -> Steps[None]:
        """Ask the workers to stop the request: set its cancel key (with ``ttl_s``), retried
        like a submit. Its result is then ``ok`` with ``finish_reason`` ``cancelled``."""
        key = ModelKeys(model).cancel(request_id)
        yield from self._retrying(SetEx(key, b"1", ttl_s), RetryBudget(self.retry_for_s))
