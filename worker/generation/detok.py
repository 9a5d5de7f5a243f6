"""Incremental detokenization with stop strings.

Text is released as tokens arrive, never a broken character (a token ending inside a
UTF-8 sequence is held back, as TGI and vLLM do), and never the start of a stop string
that may still complete: the last ``longest stop - 1`` characters wait until the next
token decides. The final text is the whole generation decoded once, cut before the first
stop string.

Decoders replace an incomplete sequence at the end by one U+FFFD, and each invalid byte
by one too; so only a *last* U+FFFD may still become a character. Earlier ones are bytes
that no later token can complete, and are released like any text (holding every text
that ends with U+FFFD stalled a stream for good when a model kept emitting such bytes).
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
    """Decoded so far, less a last U+FFFD that may be a character still incomplete."""
    whole: str = ""
    """Decoded so far, all of it."""
    sent: int = 0
    """Characters already released as deltas."""
    stopped_at: int | None = None
    """Where a stop string begins in ``text``, once one was produced."""

    def extend(self, new: Sequence[int]) -> None:
        """Take newly generated tokens."""
        if not new or self.stopped_at is not None:
            return
        self.tokens.extend(new)
        text = self.decode(self.tokens)
        self.whole = text
        self.text = text[:-1] if text.endswith("\ufffd") else text  # maybe still incomplete
        if self.stop:
            hold = max(len(s) for s in self.stop)
            window = self.text[max(0, self.sent - hold) :]
            base = max(0, self.sent - hold)
            found = [window.find(s) for s in self.stop]
            hits = [base + i for i in found if i >= 0]
            if hits:
                self.stopped_at = min(hits)

    @property
    def final_text(self) -> str:
        return self.whole if self.stopped_at is None else self.text[: self.stopped_at]

    def delta(self, final: bool = False) -> str:
        """Text not released yet that can be released now (all of it when ``final``)."""
        text = self.final_text if final or self.stopped_at is not None else self.text
        end = len(text)
        if not final and self.stopped_at is None and self.stop:
            end -= max(len(s) for s in self.stop) - 1
        if end <= self.sent:
            return ""
        out = text[self.sent : end]
        self.sent = end
        return out
