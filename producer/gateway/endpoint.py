"""What an endpoint that answers once (no stream) is made of: the request it submits and
the answer it builds from the result. The HTTP side (``app.py``) does the rest: JSON in,
submit, wait, errors, JSON out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...schemas.messages import Result


@dataclass(frozen=True, slots=True)
class Submission:
    """A request to submit: ``AsyncProducer.submit(model, **options)``."""

    model: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Answered:
    """What the answer names besides the result: its id and creation time."""

    id: str
    """The response's id (``"embd-<request id>"`` and the like)."""
    created: int
    """Unix seconds."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One unary endpoint: the OpenAI (or vLLM, Jina, Cohere) body → a submission, and
    the body with the ``ok`` result → the answer. Both raise :class:`ApiError` (400) for a
    body they refuse."""

    submission: Callable[[Mapping[str, Any]], Submission]
    answer: Callable[[Mapping[str, Any], Result, Answered], dict[str, Any]]
    id_prefix: str
    """Of the response's id."""
