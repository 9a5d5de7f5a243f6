"""Deltas a token stream lost, filled in from the result.

A Redis master acknowledges a delta before its replica has it; if it dies then, and the
replica takes over (a Redis Cluster or Sentinel failover), the delta is gone while the
worker goes on with the next (docs/reliability.md, "Cluster failover"). The stream then
skips a ``seq``: the deltas before the gap are right, and the text they miss is in the
result, which the worker stores whole. :class:`Gaps` keeps what a reader emitted of each
output since the attempt began; once the stream ended, :func:`Gaps.fill` gives one delta
per output with the rest of its result (text, tokens, and their logprobs, token ids,
content, reasoning and tool calls where the result has them, and the tool calls again as
``tool_call_chunks``: a client that reads only those, as a gateway's
chat stream does, gets every call the result holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..schemas.messages import Delta, Result
from ..schemas.tools import FunctionChunk, ToolCall, ToolCallChunk


@dataclass
class _Chunked:
    """One call as its ``tool_call_chunks`` streamed it so far."""

    id: str | None = None
    arguments: str = ""


@dataclass
class _Emitted:
    text: str = ""
    tokens: int = 0
    content: str = ""
    reasoning: str = ""
    calls: int = 0
    chunked: dict[int, _Chunked] = field(default_factory=dict)
    """The calls streamed as chunks, by their ``index``."""


class Gaps:
    """One request's stream as a reader emitted it: a gap seen, and each output's part."""

    def __init__(self) -> None:
        self.outputs: dict[int, _Emitted] = {}
        self.lost = False
        """A ``seq`` was skipped: the deltas after it are held back for :meth:`fill`."""
        self.seq = 0
        """The last ``seq`` emitted."""

    def restart(self) -> None:
        """Another attempt begins (its ``seq`` again from 1): nothing of it emitted yet."""
        self.outputs.clear()
        self.lost = False
        self.seq = 0

    def emitted(self, delta: Delta) -> None:
        self.seq = delta.seq
        out = self.outputs.setdefault(delta.input, _Emitted())
        out.text += delta.text
        out.tokens += delta.tokens
        out.content += delta.content or ""
        out.reasoning += delta.reasoning_content or ""
        out.calls += len(delta.tool_calls or [])
        for chunk in delta.tool_call_chunks or ():
            call = out.chunked.setdefault(chunk.index, _Chunked())
            call.id = chunk.id or call.id
            call.arguments += chunk.function.arguments

    def fill(self, result: Result) -> list[Delta] | None:
        """The deltas that complete what was emitted into ``result``'s outputs, numbered
        on from the last emitted; None where an output's text does not begin with what was
        emitted (the result is another attempt's)."""
        deltas: list[Delta] = []
        seq = self.seq + 1
        for i, gen in enumerate(result.generations()):
            out = self.outputs.get(i, _Emitted())
            if not gen.text.startswith(out.text):
                return None
            n = out.tokens
            delta = Delta(
                id=result.id, model=result.model, seq=seq + len(deltas), input=i,
                text=gen.text[len(out.text):], tokens=max(0, gen.completion_tokens - n),
                logprobs=None if gen.logprobs is None else gen.logprobs[n:],
                token_ids=None if gen.token_ids is None else gen.token_ids[n:],
                tool_calls=(gen.tool_calls or [])[out.calls:] or None,
                tool_call_chunks=_rest_chunks(gen.tool_calls or [], out.chunked),
                content=_rest(gen.content, out.content),
                reasoning_content=_rest(gen.reasoning_content, out.reasoning),
            )  # fmt: skip
            if _adds(delta):
                deltas.append(delta)
        return deltas


def _adds(delta: Delta) -> bool:
    """Whether ``delta`` adds anything (an output read whole gets none)."""
    return bool(delta.text or delta.tokens or delta.tool_calls or delta.tool_call_chunks
                or delta.content or delta.reasoning_content)  # fmt: skip


def _rest(whole: str | None, emitted: str) -> str | None:
    """What ``whole`` adds to ``emitted`` (None where the result has no such part)."""
    if whole is None:
        return None
    return whole[len(emitted) :] if whole.startswith(emitted) else whole


def _rest_chunks(
    calls: Sequence[ToolCall], chunked: Mapping[int, _Chunked]
) -> list[ToolCallChunk] | None:
    """The chunks that complete, from the result's ``calls``, those a reader has
    (``chunked``, by index; docs/protocol.md, "Tool calls as they are written"): a call
    begun under the same id gets the rest of its ``arguments`` under its index; one never
    begun comes whole, under the next index no chunk took (a call begun and then left out
    of the result keeps its index). None where nothing is missing."""
    index = {c.id: (k, c.arguments) for k, c in chunked.items() if c.id is not None}
    after = max(chunked, default=-1) + 1
    out: list[ToolCallChunk] = []
    for call in calls:
        fn = call.function
        k, sent = index.get(call.id, (None, ""))
        if k is not None and fn.arguments.startswith(sent):
            if len(fn.arguments) > len(sent):
                out.append(ToolCallChunk(index=k, function=FunctionChunk(
                    arguments=fn.arguments[len(sent):])))  # fmt: skip
            continue
        out.append(ToolCallChunk(index=after, id=call.id, type=call.type,
                                 function=FunctionChunk(name=fn.name, arguments=fn.arguments)))  # fmt: skip
        after += 1
    return out or None
