"""A streamed generation → OpenAI's server-sent chunks (chat or text completion).

One :class:`Chunks` per HTTP stream owns what was sent; a worker's restart mid-stream is
handled by :class:`~.replay.Replay` (repeated deltas skipped, :class:`Diverged` where the
regeneration differs). A completion's ``echo`` opens each choice with its prompt (vLLM's):
its text, and with ``logprobs`` its tokens'; what only the worker knows of it (a token-id
prompt's text, the prompt's log-probabilities) comes in the first delta of each input's
first output, and a choice waits for it (its deltas held), or for the result where an
older worker's delta has none, so the chunks add up to the whole answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...producer.tokens import Restarted
from ...schemas.messages import Delta, Generation, Result
from .answers import (
    Echo,
    as_token_ids,
    chat_logprobs,
    completion_logprobs,
    echo_of,
    finish_reason,
    scored_echo,
    usage,
)
from .endpoint import Answered
from .frontend import chat_role, stream_usage, timing_metrics
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
    held: list[Delta] | None = None
    """An echoing choice's deltas held until its prompt's echo is known (None: open)."""
    ids: list[int] | None = None
    """Its prompt's token ids (``return_token_ids``), once known."""
    ids_sent: bool = False
    """A chunk of it carried them (its first that could, as vLLM's)."""


class Chunks:
    """Builds one stream's chunks; ``chat``: ``chat.completion.chunk``, else
    ``text_completion``."""

    def __init__(self, body: Mapping[str, Any], answered: Answered, model: str, chat: bool):
        self.body, self.answered, self.model, self.chat = body, answered, model, chat
        self.include_usage, self.continuous_usage = stream_usage(body, answered.frontend)
        """The stream ends with its usage (asked, or the gateway's force); vLLM's
        ``continuous_usage_stats``: every chunk carries its choice's usage so far."""
        self.role = chat_role(body, answered.frontend) if chat else ""
        self.choices: dict[int, _Choice] = {}
        self.replay = Replay()
        self.echo = not chat and bool(body.get("echo"))
        self.texts = prompts(body) if self.echo else []
        self.n = body.get("n") or 1
        self.scored = body.get("logprobs") is not None
        self.as_ids = as_token_ids(body)
        self.token_ids = bool(body.get("return_token_ids"))
        """Each choice's first chunk has its prompt's ``prompt_token_ids`` (vLLM's: a chat's
        on the chunk, a completion's in its choice), from its first delta (or, where an
        older worker's has none, the result: then its last chunk)."""
        """The echo has the prompt's tokens (their log-probabilities from the worker)."""
        self.echoes: dict[int, Echo] = {
            i: scored_echo(p, None)
            for i, p in enumerate(self.texts) if isinstance(p, str) and not self.scored
        }  # fmt: skip
        """Per input, its prompt's echo, once known (a text's, unscored: at once)."""

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
        self, index: int, prompt: int | None = None, ids: list[int] | None = None,
        text: str | None = None,
    ) -> tuple[_Choice, list[dict[str, Any]]]:  # fmt: skip
        """Its state, and the chunks that open it (chat: the role, and ``text``, the
        rendered chat of ``return_prompt_text``, as vLLM's first chunk has it; echo: the
        prompt)."""
        if index in self.choices:
            state = self.choices[index]
            state.ids = state.ids or ids
            return state, []
        state = self.choices[index] = _Choice(prompt=prompt or 0, ids=ids)
        if self.chat:
            delta = {"role": self.role, "content": ""}
            opening = self._chunk([{"index": index, "delta": delta, "logprobs": None,
                                    "finish_reason": None}])  # fmt: skip
            if text is not None:
                opening["prompt_text"] = text
            return state, [self._with_ids(opening, state)]
        if self.echo:
            state.held = []
            return state, self._opened(index) if index // self.n in self.echoes else []
        return state, []

    def _opened(self, index: int) -> list[dict[str, Any]]:
        """An echoing choice's first chunk, its prompt's echo, then the deltas it held."""
        state = self.choices[index]
        echo = self.echoes[index // self.n]
        held, state.held, state.offset = state.held or [], None, echo.end
        opening = {"index": index, "text": echo.text, "logprobs": echo.logprobs,
                   "finish_reason": None}  # fmt: skip
        out = [self._chunk([self._with_ids(opening, state)])]
        for d in held:
            choice = self._delta_choice(d, state)
            if choice is not None:
                out.append(self._chunk([choice]))
        return out

    def _echoed(self, i: int, first: Generation | Delta) -> list[dict[str, Any]]:
        """Input ``i``'s echo, known now from its ``first`` output (or delta): its choices
        that wait for it are opened."""
        self.echoes[i] = echo_of(self.texts[i], first, self.scored, self.as_ids)
        out: list[dict[str, Any]] = []
        for k in range(i * self.n, (i + 1) * self.n):
            if k in self.choices and self.choices[k].held is not None:
                out += self._opened(k)
        return out

    def _learn(self, d: Delta) -> list[dict[str, Any]]:
        """The echo of ``d``'s input where ``d`` is the first delta of its first output
        and carries what the echo needs (an older worker's does not: the result tells)."""
        i = d.input // self.n
        if d.prompt_tokens is None or d.input % self.n or i in self.echoes:
            return []
        if (not isinstance(self.texts[i], str) and d.prompt_text is None) or (
                self.scored and d.prompt_logprobs is None):  # fmt: skip
            return []
        return self._echoed(i, d)

    def feed(self, event: Delta | Restarted) -> list[dict[str, Any]]:
        """The chunks one event of the token stream makes (maybe none)."""
        if isinstance(event, Restarted):
            self.replay.restart()
            return []
        state, out = self._choice(event.input, event.prompt_tokens, event.prompt_token_ids,
                                  event.prompt_text)  # fmt: skip
        if self.echo:
            out += self._learn(event)
        if not self.replay.fresh(event):
            return out
        state.tokens += event.tokens
        if state.held is not None:
            state.held.append(event)
            return out
        choice = self._delta_choice(event, state)
        if choice is not None:
            out.append(self._chunk([choice]))
        return out

    def _delta_choice(self, d: Delta, state: _Choice) -> dict[str, Any] | None:
        if not self.chat:
            logprobs = completion_logprobs(d.logprobs, state.offset, as_ids=self.as_ids)
            state.offset += len(d.text)
            if not (d.text or logprobs or (d.token_ids and self.token_ids) or self._ids_due(state)):
                return None
            choice = {"index": d.input, "text": d.text, "logprobs": logprobs,
                      "finish_reason": None}  # fmt: skip
            self._with_ids(choice, state)
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
            if not delta and d.logprobs is None and not d.token_ids:
                return None
            choice = {"index": d.input, "delta": delta, "finish_reason": None,
                      "logprobs": chat_logprobs(d.logprobs, self.as_ids)}  # fmt: skip
        if d.token_ids is not None and self.token_ids:
            choice["token_ids"] = d.token_ids
        return choice

    def _ids_due(self, state: _Choice) -> bool:
        """Whether the choice's next chunk is to carry its prompt's token ids."""
        return self.token_ids and state.ids is not None and not state.ids_sent

    def _with_ids(self, chunk: dict[str, Any], state: _Choice) -> dict[str, Any]:
        """``chunk`` (a chat's chunk, a completion's choice) with the choice's prompt token
        ids where they are due."""
        if self._ids_due(state):
            chunk["prompt_token_ids"], state.ids_sent = state.ids, True
        return chunk

    def finish(self, result: Result) -> list[dict[str, Any]]:
        """The last chunks: each choice's ``finish_reason`` (a choice that streamed nothing
        is opened first), then the usage if the request asked for it."""
        out: list[dict[str, Any]] = []
        gens = result.generations()
        for i in range(len(self.texts)):
            if i not in self.echoes and i * self.n < len(gens):
                out += self._echoed(i, gens[i * self.n])
        for i, g in enumerate(gens):
            ids = gens[i - i % self.n].prompt_token_ids  # its input's first output has them
            state, opening = self._choice(i, g.prompt_tokens, ids, g.prompt_text)
            state.tokens, state.prompt = g.completion_tokens, g.prompt_tokens
            out += opening
            end: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish_reason(g),
                                   "stop_reason": g.stop_reason}  # fmt: skip
            if self.chat:
                end["delta"] = {}
                out.append(self._with_ids(self._chunk([end]), state))
            else:
                end["text"] = ""
                out.append(self._chunk([self._with_ids(end, state)]))
        if self.include_usage:
            last = self._chunk([])
            last["usage"] = usage(result.usage)
            metrics = timing_metrics(result) if self.answered.frontend.per_request_metrics else None
            if metrics is not None:  # its known fields (vLLM's chunks leave out nulls)
                last["metrics"] = {k: v for k, v in metrics.items() if v is not None}
            out.append(last)
        return out
