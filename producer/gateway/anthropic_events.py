"""A streamed generation → Anthropic's Messages API events.

``message_start`` (with the first delta: the message, no content yet), then each content
block in turn, ``content_block_start``, its ``content_block_delta``s (``thinking_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop``, numbered by ``index``
from 0; a new kind of piece (the reasoning, the answer, a call) closes the block before.
Then ``message_delta`` (``stop_reason`` and ``usage``) and ``message_stop``. Each event's
``type`` is its SSE event name. Deltas a restarted generation repeats are skipped, as in
the chat route (:class:`~.replay.Replay`).
"""

from __future__ import annotations

from typing import Any

from ...producer.tokens import Restarted
from ...schemas.messages import Delta, Result
from .anthropic_answers import envelope, stop_reason, stop_sequence, usage
from .replay import Replay


class MessageEvents:
    """Builds one stream's events: :meth:`feed` per delta, :meth:`finish` with the result."""

    def __init__(self, id: str, model: str) -> None:
        self.id, self.model = id, model
        self.replay = Replay()
        self.started = False
        self.index = -1
        """The last block opened."""
        self.open: str | None = None
        """The open block's type."""
        self.call: int | None = None
        """The ``index`` of the call the open ``tool_use`` block holds."""

    def _start(self, prompt: int | None = None) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        # the prompt's size, as the first delta tells it (the prefix cache's share comes
        # with the result: message_delta's usage tells it)
        used = {"input_tokens": prompt or 0, "output_tokens": 0}
        opened = envelope(self.id, self.model, [], None, used)
        return [{"type": "message_start", "message": opened}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict[str, Any], call: int | None = None) -> list[dict[str, Any]]:
        out = self._close()
        self.index += 1
        self.open, self.call = block["type"], call
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def feed(self, event: Delta | Restarted) -> list[dict[str, Any]]:
        """The events one event of the token stream makes (maybe none)."""
        if isinstance(event, Restarted):
            self.replay.restart()
            return []
        if not self.replay.fresh(event):
            return []  # sent before the restart
        delta = event
        out = self._start(delta.prompt_tokens)
        if delta.reasoning_content:
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        text = delta.content if delta.content is not None else delta.text
        if text:
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for chunk in delta.tool_call_chunks or ():
            if chunk.id is not None:
                block = {"type": "tool_use", "id": chunk.id, "name": chunk.function.name or "",
                         "input": {}}  # fmt: skip
                out += self._open(block, chunk.index)
            if chunk.function.arguments and self.open == "tool_use" and self.call == chunk.index:
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": chunk.function.arguments}))  # fmt: skip
        return out

    def finish(self, result: Result) -> list[dict[str, Any]]:
        """The last events: the open block closed, why it stopped, the usage."""
        (g,) = result.generations()
        end = {"stop_reason": stop_reason(g), "stop_sequence": stop_sequence(g)}
        return [*self._start(), *self._close(),
                {"type": "message_delta", "delta": end, "usage": usage(result.usage)},
                {"type": "message_stop"}]  # fmt: skip
