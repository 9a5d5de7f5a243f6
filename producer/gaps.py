"""Deltas a token stream lost, filled in from the result.

A Redis master acknowledges a delta before its replica has it; if it dies then, and the
replica takes over (a Redis Cluster or Sentinel failover), the delta is gone while the
worker goes on with the next (docs/reliability.md, "Cluster failover"). The stream then
skips a ``seq``: the deltas before the gap are right, and the text they miss is in the
result, which the worker stores whole. :class:`Gaps` keeps what a reader emitted of each
output since the attempt began; once the stream ended, :func:`Gaps.fill` gives one delta
per output with the rest of its result (text, tokens, and their logprobs, token ids,
content, reasoning and tool calls where the result has them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas.messages import Delta, Result


@dataclass
class _Emitted:
    text: str = ""
    tokens: int = 0
    content: str = ""
    reasoning: str = ""
    calls: int = 0


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
            if len(gen.text) == len(out.text) and gen.completion_tokens <= out.tokens:
                continue
            n = out.tokens
            deltas.append(Delta(
                id=result.id, model=result.model, seq=seq + len(deltas), input=i,
                text=gen.text[len(out.text):], tokens=max(0, gen.completion_tokens - n),
                logprobs=None if gen.logprobs is None else gen.logprobs[n:],
                token_ids=None if gen.token_ids is None else gen.token_ids[n:],
                tool_calls=(gen.tool_calls or [])[out.calls:] or None,
                content=_rest(gen.content, out.content),
                reasoning_content=_rest(gen.reasoning_content, out.reasoning),
            ))  # fmt: skip
        return deltas


def _rest(whole: str | None, emitted: str) -> str | None:
    """What ``whole`` adds to ``emitted`` (None where the result has no such part)."""
    if whole is None:
        return None
    return whole[len(emitted) :] if whole.startswith(emitted) else whole
