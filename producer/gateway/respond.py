"""``POST /v1/responses``: OpenAI's Responses API, served as :class:`~.app.Generate` serves
chat (the same submission, waiting, disconnects and restarts), with the Responses API's
objects and its semantic server-sent events (``event: <type>`` then ``data: <json>``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...schemas.messages import Result
from .app import Gateway, Generate
from .endpoint import Answered, Events, Submission
from .errors import ApiError
from .response_input import response_submission
from .responses import ResponseEvents, response


class Responses(Generate):
    """The Responses API: whole (a ``response`` object) or streamed (its events)."""

    def initialize(self, gateway: Gateway) -> None:  # type: ignore[override]
        super().initialize(gateway, chat=True)
        self.prefix, self.named = "resp_", True
        self.sequence = 0
        """The next event's ``sequence_number`` (an error event's, after the others)."""

    def submission(self, body: Mapping[str, Any]) -> Submission:
        return response_submission(body)

    def answer(self, body: Mapping[str, Any], result: Result, answered: Answered) -> Any:
        return response(body, result, answered)

    def events(self, body: Mapping[str, Any], answered: Answered, model: str) -> Events:
        return ResponseEvents(body, answered, model)

    def _write(self, chunks: list[dict[str, Any]]) -> None:
        super()._write(chunks)
        self.sequence = chunks[-1]["sequence_number"] + 1

    def _end_with(self, error: ApiError) -> None:
        """A stream that already began ends with an ``error`` event (OpenAI's)."""
        if self.gone:
            return
        self._write([{"type": "error", "code": error.code, "message": error.message,
                      "param": error.param, "sequence_number": self.sequence}])  # fmt: skip
        self._end()
