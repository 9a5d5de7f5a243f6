"""Incremental detokenization with stop strings.

Text is released as tokens arrive, never a broken character (a token ending inside a
UTF-8 sequence is held back), and never the start of a stop string that may still
complete: the last ``longest stop - 1`` characters wait until the next token decides.

Each step decodes only a short window of the newest tokens, as TGI and vLLM do: the text
of ``tokens[prefix:read]`` (already released) against that of ``tokens[prefix:]``; the
difference is the new text. Decoding from a few tokens back rather than from the new
token alone keeps what depends on context (a leading space, a character spread over
tokens) right; decoding everything each step would cost O(n) per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[Sequence[int]], str]


@dataclass(slots=True)
class TextStream:
    """The text of one sequence as its tokens come."""

    decode: Decode
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    """Decoded so far (complete characters only)."""
    sent: int = 0
    """Characters already released as deltas."""
    stopped_at: int | None = None
    """Where a stop string begins in ``text``, once one was produced."""
    _prefix: int = 0
    _read: int = 0

    def extend(self, new: Sequence[int]) -> None:
        """Take newly generated tokens."""
        if not new or self.stopped_at is not None:
            return
        self.tokens.extend(new)
        before = self.decode(self.tokens[self._prefix : self._read])
        after = self.decode(self.tokens[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # nothing complete yet: decide with the next token
        start = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.tokens)
        if self.stop:
            # a stop string may begin in what was there before (it ends in the new text)
            from_ = max(0, start - max(len(s) for s in self.stop) + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, from_)) >= 0]
            if hits:
                self.stopped_at = min(hits)

    @property
    def final_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[: self.stopped_at]

    def delta(self, final: bool = False) -> str:
        """Text not released yet that can be released now (all of it when ``final``)."""
        end = len(self.final_text)
        if not final and self.stopped_at is None and self.stop:
            end -= max(len(s) for s in self.stop) - 1
        if end <= self.sent:
            return ""
        out = self.final_text[self.sent : end]
        self.sent = end
        return out
