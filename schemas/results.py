"""What workers write back: a request's final :class:`Result` (its status, outputs, usage,
error and timings) and the :class:`Delta` messages a streamed generation publishes while it
runs. Read tolerantly (``FROM_WIRE``): later v1 workers may add fields and statuses."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field, ValidationInfo, field_validator

from .errors import ErrorCode
from .outputs import Generation, TokenLogprob
from .tools import ToolCall, ToolCallChunk
from .version import SCHEMA_VERSION
from .wire import FROM_WIRE, _Answer

Status = Literal["ok", "error", "expired"]
"""The statuses workers of this version write. Readers must accept others (see
docs/protocol.md, "What may change within v1"): a decoded ``Result.status`` is any string."""
OK: Final = "ok"
ERROR: Final = "error"
EXPIRED: Final = "expired"
KNOWN_STATUSES: Final = frozenset({OK, ERROR, EXPIRED})


class ErrorInfo(_Answer):
    """Why a request was not answered ``ok``: a stable ``code`` and a human-readable message."""

    code: ErrorCode | str
    """An :class:`ErrorCode` when this client knows it; a decoded result keeps an unknown code
    as its string (new codes may appear within v1)."""
    message: str

    @field_validator("code", mode="before")
    @classmethod
    def _known_code(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str) and not isinstance(v, ErrorCode):
            if v in ErrorCode._value2member_map_:
                return ErrorCode(v)
            if not cls._from_wire(info):
                raise ValueError(f"unknown error code {v!r}")
        return v

    @field_validator("message")
    @classmethod
    def _short(cls, v: str) -> str:
        return v if len(v) <= 1000 else v[:997] + "..."


class Timings(_Answer):
    """Where a request's time went (milliseconds, Redis server clock)."""

    queued_ms: float = 0.0
    """Enqueue → read by a worker."""
    batch_wait_ms: float = 0.0
    """Read → its batch was dispatched."""
    inference_ms: float = 0.0
    """Its batch's run time on the device."""
    total_ms: float = 0.0
    """Enqueue → result written."""
    batch_size: int = 0
    """Rows in its batch."""
    batch_id: str = ""
    worker: str = ""
    first_token_ms: float | None = None
    """Generation: enqueue → the end of the step that generated its first token (kept
    across a preemption; a runner that does not report the tokens of each step: its first
    delta's, or its result's). vLLM's ``first_token_ts`` as the gateway's per-request
    metrics read it."""


class PromptTokensDetails(_Answer):
    """OpenAI's ``usage.prompt_tokens_details``."""

    cached_tokens: int = 0
    """Prompt tokens not prefilled for this request: taken from the worker's prefix cache,
    or from the prefill of the same prompt sent with it (vLLM's ``num_cached_tokens``)."""


class Usage(_Answer):
    """Tokens a request used, over all its inputs: a generation's (a prompt counts once
    whatever its ``n``; every completion's tokens count), or an encoder's input tokens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class Delta(_Answer):
    """Newly generated text of one input, published on the reply channel (``kind`` "delta")
    and appended to the request's token stream while it generates."""

    v: Literal[1] = SCHEMA_VERSION
    kind: Literal["delta"] = "delta"
    id: str
    model: str = ""
    seq: int
    """1, 2, ... per request (over all its inputs): a reader that saw ``seq`` n has all
    deltas up to n."""
    input: int = 0
    """Which output (0-based) the text belongs to: its input's index (with the request's
    ``n``, input ``i``'s completion ``j`` is ``i * n + j``)."""
    text: str
    tokens: int
    """Tokens this delta holds."""
    logprobs: list[TokenLogprob] | None = None
    """With the request's ``logprobs``: one per token this delta holds (see
    :attr:`Generation.logprobs`); absent otherwise."""
    tool_calls: list[ToolCall] | None = None
    """With the request's ``tools``: calls the output's text completed with this delta,
    each streamed once, in order, with the id the result gives it (the result's
    ``tool_calls`` begin with them); absent otherwise."""
    tool_call_chunks: list[ToolCallChunk] | None = None
    """With the request's ``tools``: the calls as they are written, OpenAI's
    ``delta.tool_calls`` (see :class:`ToolCallChunk`): a call's id and name once its name is
    written, then its ``arguments`` piece by piece; a call's pieces add up to the one the
    result holds (same id); ``index`` counts the calls streamed (a call the model began but
    wrote badly, which the result leaves out, keeps its index); absent otherwise."""
    token_ids: list[int] | None = None
    """With the request's ``return_token_ids``: the tokens this delta holds (``tokens``
    of them); absent otherwise."""
    prompt_tokens: int | None = None
    """In the first delta of each output: its prompt's tokens (the result's
    ``prompt_tokens`` for it), so a stream can report its usage as it goes; absent in the
    others, and from workers before it was added."""
    prompt_text: str | None = None
    """With the request's ``return_prompt_text`` and ``stream``, in the first delta of the
    first output of each input (``i * n``): the result's ``prompt_text`` of it, so a stream
    can echo its prompt before the generated text; absent otherwise, and from workers
    before it was added."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With the request's ``prompt_logprobs`` and ``stream``, where ``prompt_text`` would
    be: the result's ``prompt_logprobs`` of that output; absent otherwise, and from workers
    before it was added."""
    prompt_token_ids: list[int] | None = None
    """With the request's ``return_token_ids`` and ``stream``, in the first delta of each
    output (as ``prompt_tokens``): its prompt's tokens (the result's ``prompt_token_ids``
    of its input), so a stream can give each choice its prompt's ids first (vLLM's); absent
    otherwise, and from workers before it was added."""
    content: str | None = None
    """Where the output has a ``content`` (see :attr:`Generation.content`): what this
    delta adds to it (maybe empty); the deltas' pieces add up to the result's ``content``.
    A tool call's markup and the reasoning are not in it; a piece may lag ``text`` (what
    may yet be a call's or the reasoning's start is held back, as is trailing whitespace);
    absent otherwise."""
    reasoning_content: str | None = None
    """From a model with a ``reasoning_parser``: what this delta adds to the output's
    ``reasoning_content`` (maybe empty), the same way; absent otherwise."""


class Result(_Answer):
    """The final answer to one request: stored at its result key and published.

    Workers build it with a known :data:`Status`; clients decode it with
    :func:`~batchfleet.schemas.codec.decode_result`, which keeps any ``status`` string: a
    status this client does not know is a final, non-``ok`` answer.
    """

    v: Literal[1] = SCHEMA_VERSION
    id: str
    model: str
    status: str
    """``ok``, ``error``, ``expired`` (:data:`OK`, :data:`ERROR`, :data:`EXPIRED`), or, decoded
    from a later v1 worker, a status this client does not know."""
    outputs: list[Any] | None = None
    """One output per input (``ok`` only): an embedding list, a classification map, or a
    :class:`Generation` map (``n`` per input with a generation request's ``n``)."""
    truncated: list[bool] | None = None
    """Per input: was it cut to the model's max tokens?"""
    usage: Usage | None = None
    """Tokens used over all inputs: a generation's prompts and completions; an encoder's
    ``prompt_tokens`` only (every row it ran, as cut to its ``max_tokens``)."""
    error: ErrorInfo | None = None
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, str] = Field(default_factory=dict)
    finished_at_ms: int = 0
    """Unix ms (Redis clock) when the result was written."""

    @field_validator("status")
    @classmethod
    def _known_status(cls, v: str, info: ValidationInfo) -> str:
        if v not in KNOWN_STATUSES and not cls._from_wire(info):
            raise ValueError(f"status must be one of {sorted(KNOWN_STATUSES)}, got {v!r}")
        return v

    @property
    def ok(self) -> bool:
        """True for status ``ok`` only (never for a status this client does not know)."""
        return self.status == OK

    def generations(self) -> list[Generation]:
        """A generation model's outputs as :class:`Generation` maps (text, ``finish_reason``,
        token counts), one per input; empty when the result has no outputs."""
        return [
            g
            if isinstance(g, Generation)
            else Generation.model_validate(g, context={FROM_WIRE: True})
            for g in self.outputs or []
        ]
