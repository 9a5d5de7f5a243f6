"""A streamed generation → OpenAI's server-sent chunks (chat or text completion).

One :class:`Chunks` per HTTP stream owns what was sent; a worker's restart mid-stream is
handled by :class:`~.replay.Replay` (repeated deltas skipped, :class:`Diverged` where the
regeneration differs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...producer.tokens import Restarted
from ...schemas.messages import Delta, Result
from .answers import chat_logprobs, completion_logprobs, finish_reason, usage
from .endpoint import Answered
from .openai_fields import prompts
from .replay import Diverged, Replay

__all__ = ["Chunks", "Diverged"]


@dataclass
class _Choice:
    offset: int = 0
    """Characters sent (completions' ``text_offset``)."""
    prompt: int = 0
    """Its prompt's tokens (its first delta tells them)."""
    tokens: int = 0
    """Tokens sent."""


class Chunks:
    """Builds one stream's chunks; ``chat``: ``chat.completion.chunk``, else
    ``text_completion``."""

    def __init__(self, body: Mapping[str, Any], answered: Answered, model: str, chat: bool):
        self.body, self.answered, self.model, self.chat = body, answered, model, chat
        options = body.get("stream_options")
        self.include_usage = bool(isinstance(options, Mapping) and options.get("include_usage"))
        self.continuous_usage = bool(self.include_usage and isinstance(options, Mapping)
                                     and options.get("continuous_usage_stats"))  # fmt: skip
        """vLLM's: every chunk carries its choice's usage so far."""
        self.choices: dict[int, _Choice] = {}
        self.replay = Replay()

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.answered.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.answered.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
            if self.continuous_usage and choices:
                state = self.choices[choices[0]["index"]]
                out["usage"] = {"prompt_tokens": state.prompt, "completion_tokens": state.tokens,
                                "total_tokens": state.prompt + state.tokens}  # fmt: skip
        return out

    def _choice(
        self, index: int, prompt: int | None = None
    ) -> tuple[_Choice, list[dict[str, Any]]]:
        """Its state, and the chunks that open it (chat: the role; echo: the prompt)."""
        if index in self.choices:
            return self.choices[index], []
        state = self.choices[index] = _Choice(prompt=prompt or 0)
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return state, [self._chunk([{"index": index, "delta": delta, "logprobs": None,
                                         "finish_reason": None}])]  # fmt: skip
        if self.body.get("echo"):
            texts = prompts(self.body)
            n = self.body.get("n") or 1
            text = str(texts[index // n])
            state.offset = len(text)
            return state, [self._chunk([{"index": index, "text": text, "logprobs": None,
                                         "finish_reason": None}])]  # fmt: skip
        return state, []

    def feed(self, event: Delta | Restarted) -> list[dict[str, Any]]:
        """The chunks one event of the token stream makes (maybe none)."""
        if isinstance(event, Restarted):
            self.replay.restart()
            return []
        state, out = self._choice(event.input, event.prompt_tokens)
        if not self.replay.fresh(event):
            return out
        state.tokens += event.tokens
        choice = self._delta_choice(event, state)
        if choice is not None:
            out.append(self._chunk([choice]))
        return out

    def _delta_choice(self, d: Delta, state: _Choice) -> dict[str, Any] | None:
        if not self.chat:
            logprobs = completion_logprobs(d.logprobs, state.offset)
            state.offset += len(d.text)
            if not d.text and logprobs is None:
                return None
            choice = {"index": d.input, "text": d.text, "logprobs": logprobs,
                      "finish_reason": None}  # fmt: skip
        else:
            delta: dict[str, Any] = {}
            content = d.content if d.content is not None else d.text
            if content:
                delta["content"] = content
            if d.reasoning_content:
                delta["reasoning_content"] = delta["reasoning"] = d.reasoning_content
            if d.tool_call_chunks:
                delta["tool_calls"] = [c.model_dump(exclude_none=True)
                                       for c in d.tool_call_chunks]  # fmt: skip
            if not delta and d.logprobs is None:
                return None
            choice = {"index": d.input, "delta": delta, "logprobs": chat_logprobs(d.logprobs),
                      "finish_reason": None}  # fmt: skip
        if d.token_ids is not None:
            choice["token_ids"] = d.token_ids
        return choice

    def finish(self, result: Result) -> list[dict[str, Any]]:
        """The last chunks: each choice's ``finish_reason`` (a choice that streamed nothing
        is opened first), then the usage if the request asked for it."""
        out: list[dict[str, Any]] = []
        for i, g in enumerate(result.generations()):
            state, opening = self._choice(i, g.prompt_tokens)
            state.tokens, state.prompt = g.completion_tokens, g.prompt_tokens
            out += opening
            end: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish_reason(g),
                                   "stop_reason": g.stop_reason}  # fmt: skip
            if self.chat:
                end["delta"] = {}
            else:
                end["text"] = ""
            out.append(self._chunk([end]))
        if self.include_usage:
            last = self._chunk([])
            last["usage"] = usage(result.usage)
            out.append(last)
        return out
