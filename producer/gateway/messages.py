"""``POST /v1/messages``: Anthropic's Messages API, as vLLM serves it (and its
``/v1/messages/count_tokens``).

The chat route's handler with Anthropic's translations: its request, its message and its
events (``event: <type>``), its errors (``{"type": "error", "error": {"type", "message"}}``,
the chat route's HTTP statuses). Waiting, streaming, a worker's restart mid-stream and a
client that leaves are the chat route's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...schemas.messages import Result
from . import anthropic_answers, anthropic_fields
from .anthropic_events import MessageEvents
from .endpoint import Answered, Events, Submission
from .errors import ApiError
from .generate import Generate
from .state import Gateway
from .unary import Unary


class Messages(Generate):
    """Anthropic's ``message`` whole, or its server-sent events."""

    def initialize(self, gateway: Gateway) -> None:  # type: ignore[override]
        super().initialize(gateway, chat=True)
        self.prefix, self.named = "msg_", True

    def submission(self, body: Mapping[str, Any]) -> Submission:
        return anthropic_fields.submission(body)

    def answer(self, body: Mapping[str, Any], result: Result, answered: Answered) -> Any:
        return anthropic_answers.message(result, answered.id)

    def events(self, body: Mapping[str, Any], answered: Answered, model: str) -> Events:
        return MessageEvents(answered.id, model)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return anthropic_answers.error_body(error)


class CountTokens(Unary):
    """``/v1/messages/count_tokens``: a unary endpoint with Anthropic's errors."""

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return anthropic_answers.error_body(error)
