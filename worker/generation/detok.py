"""Incremental detokenization with stop strings.

Text is released as tokens arrive, never a broken character, and never the start of a
stop string that may still complete: the last ``longest stop - 1`` characters wait until
the next token decides.

Each step decodes only a short window of the newest tokens, as TGI and vLLM do: the text
of ``tokens[prefix:read]`` (already committed) against that of ``tokens[prefix:]``; the
difference is the new text. Decoding from a few tokens back rather than from the new
token alone keeps what depends on context (a leading space, a character spread over
tokens) right; decoding everything each step would cost O(n) per token.

Decoders replace an incomplete sequence at the end by one U+FFFD, and each invalid byte
by one too; so only a *last* U+FFFD may still become a character and is held back.
Earlier ones are bytes no later token can complete, and are released like any text
(holding every text that ends with U+FFFD stalled a stream for good when a model kept
emitting such bytes). The final text is everything decoded, a last U+FFFD included.

While a last U+FFFD is held the window cannot move on at its end, so it moves on a few
tokens back instead, to where the text is settled (later tokens no longer change it): a
model emitting a run of broken bytes (the random benchmark model does, on an eighth of
its rows) would otherwise make every token decode the whole run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[Sequence[int]], str]
HELD = "\ufffd"
SETTLE = 4
"""Tokens behind the newest where a held window moves on: an incomplete character's bytes
(at most 3) lie in the last 3 tokens."""


@dataclass(slots=True)
class TextStream:
    """The text of one sequence as its tokens come."""

    decode: Decode
    stop: tuple[str, ...] = ()
    keep_stop: bool = False
    """The final text keeps the stop string that ended it (vLLM's
    ``include_stop_str_in_output``)."""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    """Decoded so far, without a last character that may still be incomplete."""
    sent: int = 0
    """Characters already released as deltas."""
    stopped_at: int | None = None
    """Where a stop string begins in ``text``, once one was produced."""
    stop_end: int = 0
    """Where that stop string ends in ``text``."""
    stop_string: str | None = None
    """That stop string (what vLLM's ``stop_reason`` reports)."""
    _base: str = ""
    """The text of ``tokens[:read]`` (complete)."""
    _tail: str = ""
    """The text of ``tokens[read:]``, a last U+FFFD included."""
    _prefix: int = 0
    _read: int = 0

    def extend(self, new: Sequence[int]) -> None:
        """Take newly generated tokens."""
        if not new or self.stopped_at is not None:
            return
        self.tokens.extend(new)
        before = self.decode(self.tokens[self._prefix : self._read])
        after = self.decode(self.tokens[self._prefix :])
        tail = after[len(before) :]
        start = len(self.text)
        if tail.endswith(HELD):
            self._tail = tail
            self.text = self._base + tail[:-1]
            if len(self.tokens) - self._read >= 2 * SETTLE:
                self._settle(before, after)
        else:  # complete: commit it and move the window on
            self._base += tail
            self._tail = ""
            self.text = self._base
            self._prefix, self._read = self._read, len(self.tokens)
        if self.stop and len(self.text) > start:
            # a stop string may begin in what was there before (it ends in the new text)
            from_ = max(0, start - max(len(s) for s in self.stop) + 1)
            hits = [(i, k) for k, s in enumerate(self.stop) if (i := self.text.find(s, from_)) >= 0]
            if hits:  # the first to begin (the first given, of those beginning there)
                at, k = min(hits)
                self.stopped_at, self.stop_end = at, at + len(self.stop[k])
                self.stop_string = self.stop[k]

    def _settle(self, before: str, after: str) -> None:
        """Move a held window on to ``SETTLE`` tokens back, if the text there is settled:
        it is a prefix of the whole window's text, and more text follows it (so a broken
        character at its end was not completed by the tokens after it)."""
        mid_at = len(self.tokens) - SETTLE
        mid = self.decode(self.tokens[self._prefix : mid_at])
        if (
            len(before) <= len(mid) < len(after)
            and after.startswith(mid)
            and mid.startswith(before)
        ):
            self._base += mid[len(before) :]
            self._tail = after[len(mid) :]
            self._prefix, self._read = self._read, mid_at

    @property
    def final_text(self) -> str:
        if self.stopped_at is not None:
            return self.text[: self.stop_end if self.keep_stop else self.stopped_at]
        return self._base + self._tail

    @property
    def released(self) -> str:
        """The text the deltas released so far."""
        text = self.text if self.sent <= len(self.text) else self.final_text
        return text[: self.sent]

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
