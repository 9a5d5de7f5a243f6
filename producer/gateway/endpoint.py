"""What an endpoint is made of: the request it submits and the answer it builds from the
result (or, streamed, the events it builds from the deltas). The HTTP side (:mod:`.handler`)
does the rest: JSON in, submit, wait, errors, JSON or server-sent events out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...schemas.messages import Delta, Result
from ..tokens import Restarted
from .frontend import Frontend


@dataclass(frozen=True, slots=True)
class Submission:
    """A request to submit: ``AsyncProducer.submit(model, **options)``."""

    model: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Answered:
    """What the answer names besides the result: its id and creation time (and, unary
    answers, the model's context length)."""

    id: str
    """The response's id (``"embd-<request id>"`` and the like)."""
    created: int
    """Unix seconds."""
    max_model_len: int | None = None
    """The model's, as its workers published it (``ModelInfo``); None: they did not."""
    sampling: Mapping[str, float | int] = field(default_factory=dict)
    """The model's sampling defaults (``ModelInfo.sampling_defaults``): what a request
    that sets no ``temperature`` or ``top_p`` samples with, echoed as such."""
    frontend: Frontend = field(default_factory=Frontend)
    """The gateway's switches of chat and completion answers (vLLM's frontend flags)."""
    system_fingerprint: str | None = None
    """A whole chat or completion answer's (:mod:`.fingerprint`: the model's)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One unary endpoint: the OpenAI (or vLLM, Jina, Cohere) body → a submission, and
    the body with the ``ok`` result → the answer. Both raise :class:`ApiError` (400) for a
    body they refuse."""

    submission: Callable[[Mapping[str, Any]], Submission]
    answer: Callable[[Mapping[str, Any], Result, Answered], dict[str, Any]]
    id_prefix: str
    """Of the response's id."""
    encoder: bool = False
    """Answered by encoder models only (the pooling endpoints): a model whose workers
    publish a generator's info is refused before anything is submitted, as its worker
    would take the texts as prompts and generate for them."""


class Events(Protocol):
    """One stream's answer, built as its events come (chat chunks, Responses API events):
    what each delta, restart and the ``ok`` result add (maybe nothing)."""

    def feed(self, event: Delta | Restarted) -> list[dict[str, Any]]: ...

    def finish(self, result: Result) -> list[dict[str, Any]]: ...
