"""Requests' token streams: the entries a generating worker appends (:class:`TokenWrite`)
and appending them with ``tokens.lua``, which also publishes each delta's message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from .redis_model import ModelRedis

TOKENS_MAXLEN = 100_000
"""A token stream's approximate MAXLEN (far above any request's tokens: a bound, not a cut)."""
TOKENS_CHUNK = 256
"""Token-stream entries per ``tokens.lua`` call."""
_TOKENS_MAXLEN_ARG = b"$%d\r\n%d\r\n" % (len(str(TOKENS_MAXLEN)), TOKENS_MAXLEN)


@dataclass(slots=True)  # not frozen: one per token and row (4x cheaper to build)
class TokenWrite:
    """One entry of a request's token stream: a delta (``text`` set), published on
    ``reply`` too, or (``text`` None) the stream's end."""

    request_id: str
    seq: int
    ttl_s: int
    """The stream's TTL, set with this entry (0: left as it is)."""
    text: str | None = None
    input: int = 0
    tokens: int = 0
    reply: str | None = None
    json: bool = False
    """The delta's message in JSON (else msgpack)."""
    model: str = ""
    logprobs: str | None = None
    """The delta's ``logprobs`` as JSON text (None: its request did not ask)."""
    life: int = 0
    """The writer's attempt at the request (its entry's delivery count; 0: none), negative
    where ``tokens.lua`` is to check it against the stream's last entry's."""
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
    """Its output's prompt tokens (in its first delta; None: the others)."""
    prompt_text: str | None = None
    """Its input's prompt text (the first delta of its first output, where asked)."""
    prompt_logprobs: str | None = None
    """Its input's prompt log-probabilities as JSON text (where ``prompt_text`` would be)."""
    prompt_token_ids: str | None = None
    """Its prompt's token ids as JSON text (its output's first delta, where asked)."""

    def item(self) -> list[Any]:
        """The entry as ``tokens.lua`` takes it."""
        if self.text is None:
            return [self.seq, self.ttl_s, self.life]
        item = delta_item(self.seq, self.ttl_s, self.life, self.input, self.text, self.tokens,
                          self.reply, self.json, self.request_id, self.model)  # fmt: skip
        if (self.logprobs is None and self.tool_calls is None and self.token_ids is None
                and self.tool_call_chunks is None and self.content is None
                and self.reasoning is None and self.prompt_tokens is None
                and self.prompt_text is None and self.prompt_logprobs is None
                and self.prompt_token_ids is None):  # fmt: skip
            return item  # most deltas (a third of the cost of building ``more`` below)
        prompt = None if self.prompt_tokens is None else str(self.prompt_tokens)
        more = [
            [name, value, raw]
            for name, value, raw in (
                ("logprobs", self.logprobs, 1),
                ("tool_calls", self.tool_calls, 1),
                ("token_ids", self.token_ids, 1),
                ("tool_call_chunks", self.tool_call_chunks, 1),
                ("content", self.content, 0),
                ("reasoning_content", self.reasoning, 0),
                ("prompt_tokens", prompt, 1),
                ("prompt_text", self.prompt_text, 0),
                ("prompt_logprobs", self.prompt_logprobs, 1),
                ("prompt_token_ids", self.prompt_token_ids, 1),
            )
            if value is not None
        ]
        if more:
            item.append(more)
        return item


def delta_item(seq: int, ttl_s: int, life: int, input: int, text: str, tokens: int,
               reply: str | None, json: bool, request_id: str, model: str) -> list[Any]:  # fmt: skip
    """A delta's entry as ``tokens.lua`` takes it, without the optional fields (most
    deltas: see :meth:`TokenWrite.item`)."""
    return [seq, ttl_s, life, input, text, tokens, reply or "", int(json), request_id, model]


class Writable(Protocol):
    """What :meth:`TokenStreams.tokens_commands` packs: a :class:`TokenWrite`, or what
    makes one (``worker/streamed.py``: most deltas' entry without it)."""

    @property
    def request_id(self) -> str: ...

    def item(self) -> list[Any]:
        """The entry as ``tokens.lua`` takes it (:meth:`TokenWrite.item`)."""
        ...


class TokenStreams(ModelRedis):
    """Appends to the model's requests' token streams (``tokens.lua``)."""

    def append_tokens(self, items: Sequence[Writable]) -> None:
        """Append entries to requests' token streams and publish the deltas' messages
        (encoded by the script): one ``tokens.lua`` call per ``TOKENS_CHUNK`` items, the
        items packed in one argument, called directly (a pipeline holding a script first
        asks SCRIPT EXISTS)."""
        for start in range(0, len(items), TOKENS_CHUNK):
            chunk = items[start : start + TOKENS_CHUNK]
            packed = msgpack.packb([it.item() for it in chunk])
            self._tokens(keys=[self.keys.tokens(it.request_id) for it in chunk],
                         args=[TOKENS_MAXLEN, packed])  # fmt: skip

    def tokens_commands(self, items: Sequence[Writable]) -> list[bytes]:
        """:meth:`append_tokens` as packed ``EVALSHA`` commands, one per ``TOKENS_CHUNK``
        items, for a connection of the caller's own (worker/token_writes.py): packed here,
        a step's call costs a tenth of the client's argument encoding."""
        sha = self._tokens.sha.encode()
        prefix = self.keys.tokens("").encode()  # each key: this and the request's id
        out: list[bytes] = []
        for start in range(0, len(items), TOKENS_CHUNK):
            chunk = items[start : start + TOKENS_CHUNK]
            n = len(chunk)
            packed = msgpack.packb([it.item() for it in chunk])
            parts = [b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n$%d\r\n%d\r\n"
                     % (n + 5, len(sha), sha, len(str(n)), n)]  # fmt: skip
            for it in chunk:
                rid = it.request_id.encode()
                parts.append(b"$%d\r\n%s%s\r\n" % (len(prefix) + len(rid), prefix, rid))
            parts.append(_TOKENS_MAXLEN_ARG)
            parts.append(b"$%d\r\n%s\r\n" % (len(packed), packed))
            out.append(b"".join(parts))
        return out

    def load_tokens_script(self) -> None:
        """Load ``tokens.lua`` (after ``NOSCRIPT``: a restarted or flushed Redis)."""
        self.client.script_load(self._tokens.script)
