"""A generating request's delta, or its token stream's end, as the sink writes it.

A generating worker makes one :class:`Streamed` per token and row, so it holds plain
fields (JSON text, not models): :meth:`Streamed.write` is the token-stream entry ``tokens.lua``
appends, :attr:`Streamed.delta` the :class:`~..schemas.messages.Delta` message. Kept apart
from ``sink.py``, which queues and writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from ..schemas.codec import (
    logprobs_json,
    prompt_logprobs_json,
    token_ids_json,
    tool_calls_json,
    tool_chunks_json,
)
from ..schemas.messages import Delta, Format
from .token_stream import TokenWrite, delta_item

EXPIRE_EVERY = 64
"""A token stream's TTL is (re)set with its 1st, 65th, ... entry and its end entry: one
EXPIRE per delta would be a third of the commands a generating worker sends."""


@dataclass(slots=True)  # not frozen: one per token and row (4x cheaper to build)
class Streamed:
    """A delta of a generating request (``text`` set), or the end of its token stream.
    Plain fields, no :class:`Delta`: a generating worker makes one per token and row."""

    request_id: str
    seq: int
    text: str | None
    ttl_s: int
    reply: str | None
    fmt: Format
    input: int = 0
    tokens: int = 0
    model: str = ""
    logprobs: str | None = None
    """The delta's ``logprobs`` as JSON text (its request asked for them)."""
    life: int = 0
    """The writer's attempt at the request (see :class:`~.deltas.StreamTo`; 0: none),
    negative where ``tokens.lua`` checks it against the stream's last entry."""
    tool_calls: str | None = None
    """The tool calls the delta completed, as JSON text (None: none)."""
    content: str | None = None
    """What the delta adds to its output's ``content`` (None: the output has none)."""
    reasoning: str | None = None
    """What it adds to its output's ``reasoning_content`` (None: the output has none)."""
    token_ids: str | None = None
    """Its tokens' ids as JSON text (None: its request did not ask)."""
    tool_call_chunks: str | None = None
    """The calls' pieces it wrote, as JSON text (None: none)."""
    prompt_tokens: int | None = None
    """Its output's prompt tokens (its first delta only)."""
    prompt_text: str | None = None
    """Its input's prompt text (the first delta of its first output, where asked)."""
    prompt_logprobs: str | None = None
    """Its input's prompt log-probabilities as JSON text (where ``prompt_text`` would be)."""
    prompt_token_ids: str | None = None
    """Its prompt's token ids as JSON text (its output's first delta, where asked)."""
    plain: bool = field(default=False, compare=False)
    """A delta with none of the optional fields above (its maker knows it: see
    :meth:`item`)."""

    @classmethod
    def of(cls, delta: Delta, ttl_s: int, reply: str | None, fmt: Format) -> Streamed:
        lps = None if delta.logprobs is None else logprobs_json(delta.logprobs)
        calls = None if delta.tool_calls is None else tool_calls_json(delta.tool_calls)
        ids = None if delta.token_ids is None else token_ids_json(delta.token_ids)
        pieces = delta.tool_call_chunks
        scored = delta.prompt_logprobs
        prompt_ids = delta.prompt_token_ids
        return cls(delta.id, delta.seq, delta.text, ttl_s, reply, fmt, delta.input,
                   delta.tokens, delta.model, lps, tool_calls=calls, content=delta.content,
                   reasoning=delta.reasoning_content, token_ids=ids,
                   tool_call_chunks=None if pieces is None else tool_chunks_json(pieces),
                   prompt_tokens=delta.prompt_tokens, prompt_text=delta.prompt_text,
                   prompt_logprobs=None if scored is None else prompt_logprobs_json(scored),
                   prompt_token_ids=None if prompt_ids is None
                   else token_ids_json(prompt_ids))  # fmt: skip

    @property
    def delta(self) -> Delta | None:
        """The delta message (None: the stream's end)."""
        if self.text is None:
            return None
        lps = None if self.logprobs is None else json.loads(self.logprobs)
        calls = None if self.tool_calls is None else json.loads(self.tool_calls)
        ids = None if self.token_ids is None else json.loads(self.token_ids)
        pieces = None if self.tool_call_chunks is None else json.loads(self.tool_call_chunks)
        return Delta(id=self.request_id, model=self.model, seq=self.seq, input=self.input,
                     text=self.text, tokens=self.tokens, logprobs=lps, tool_calls=calls,
                     content=self.content, reasoning_content=self.reasoning,
                     token_ids=ids, tool_call_chunks=pieces,
                     prompt_tokens=self.prompt_tokens, prompt_text=self.prompt_text,
                     prompt_logprobs=None if self.prompt_logprobs is None
                     else json.loads(self.prompt_logprobs),
                     prompt_token_ids=None if self.prompt_token_ids is None
                     else json.loads(self.prompt_token_ids))  # fmt: skip

    def item(self) -> list[Any]:
        """:meth:`write`'s entry as ``tokens.lua`` takes it; a plain delta's without the
        :class:`TokenWrite` (the device thread writes one per row and step: building it
        cost more than packing the entry)."""
        if not self.plain or self.text is None:
            return self.write().item()
        ttl = self.ttl_s if self.seq % EXPIRE_EVERY == 1 else 0
        return delta_item(self.seq, ttl, self.life, self.input, self.text, self.tokens,
                          self.reply, self.fmt == "json", self.request_id, self.model)  # fmt: skip

    def write(self) -> TokenWrite:
        """The token-stream entry (and message) to write."""
        if self.text is None:  # the end entry sets the final TTL
            return TokenWrite(self.request_id, self.seq, self.ttl_s, life=self.life)
        ttl = self.ttl_s if self.seq % EXPIRE_EVERY == 1 else 0
        return TokenWrite(self.request_id, self.seq, ttl, self.text, self.input, self.tokens,
                          self.reply, self.fmt == "json", self.model, self.logprobs,
                          self.life, self.tool_calls, self.content, self.reasoning,
                          self.token_ids, self.tool_call_chunks, self.prompt_tokens,
                          self.prompt_text, self.prompt_logprobs,
                          self.prompt_token_ids)  # fmt: skip


_FIELDS = ("request_id", "seq", "text", "ttl_s", "reply", "fmt", "input", "tokens", "model",
           "logprobs", "life", "tool_calls", "content", "reasoning", "token_ids",
           "tool_call_chunks", "prompt_tokens", "prompt_text", "prompt_logprobs",
           "prompt_token_ids", "plain")  # fmt: skip
if tuple(f.name for f in fields(Streamed)) != _FIELDS:
    raise RuntimeError("Streamed's fields changed: update plain_delta() below")


def plain_delta(
    request_id: str,
    seq: int,
    text: str,
    ttl_s: int,
    reply: str | None,
    fmt: Format,
    input: int,
    tokens: int,
    model: str,
    life: int,
) -> Streamed:
    """A plain delta (``plain=True``, none of the optional fields), equal to the same
    ``Streamed(...)`` with keywords at about two thirds of its cost: every field passed by
    position (keywords cost the dataclass's ``__init__`` more than the fields themselves;
    the device thread makes one per row and step)."""
    return Streamed(request_id, seq, text, ttl_s, reply, fmt, input, tokens, model, None,
                    life, None, None, None, None, None, None, None, None, None,
                    True)  # fmt: skip
