"""Beam search as vLLM runs it: above the engine, one round per generated token.

Each round, every live beam of a prompt runs in the engine as a one-token sequence (its
prompt and the beam's tokens, ``max_new_tokens`` 1) that keeps its token's ``2 * width``
likeliest alternatives; the prefix cache makes the shared prompt cheap to run again. Each
beam grows by each alternative (its cumulative log-probability plus the token's); a
candidate that ends (an end-of-sequence token, unless ``ignore_eos``; a stop token id; a
stop string) joins the finished ones, and the ``width`` best of the others are the next
round's beams. After ``max_new_tokens`` rounds (or with no beam left) the live beams join
the finished ones, and the ``width`` best of all are the outputs, best first.

A beam is ranked as vLLM's ``get_beam_search_score``: its cumulative log-probability over
its length (prompt included, a final end-of-sequence token not) to the power
``length_penalty``. Nothing here touches the engine or torch: the runner feeds each
round's alternatives to :meth:`BeamSearch.advance`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Ending = Callable[[tuple[int, ...]], tuple[str, str | int | None] | None]
"""Whether a beam's tokens end it here: its finish reason and stop reason (None: not)."""


@dataclass(frozen=True, slots=True)
class Beam:
    """One hypothesis: its generated tokens and their summed log-probability."""

    tokens: tuple[int, ...]
    logprob: float
    finish: str | None = None
    """``stop`` or ``length`` once it ended (None: live)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it (vLLM's ``stop_reason``)."""


def score(beam: Beam, prompt: int, length_penalty: float, eos: frozenset[int]) -> float:
    """vLLM's ``get_beam_search_score``: the cumulative log-probability over the whole
    sequence's length (``prompt`` tokens and the beam's, less an ending end-of-sequence
    token) to the power ``length_penalty``."""
    n = prompt + len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos:
        n -= 1
    scale: float = float(max(n, 1)) ** length_penalty
    return beam.logprob / scale


class BeamSearch:
    """One prompt's beam search (the module docstring), round by round."""

    def __init__(self, prompt: int, width: int, max_new: int, length_penalty: float,
                 eos: frozenset[int], ending: Ending) -> None:  # fmt: skip
        self.prompt = prompt
        self.width = width
        self.max_new = max_new
        self.length_penalty = length_penalty
        self.eos = eos
        """The end-of-sequence tokens as ranking counts them (empty with ``ignore_eos``)."""
        self.ending = ending
        self.live: list[Beam] = [Beam((), 0.0)] if max_new > 0 else []
        self.finished: list[Beam] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return not self.live

    @property
    def alternatives(self) -> int:
        """The likeliest tokens each beam's round keeps (vLLM's ``2 * beam_width``)."""
        return 2 * self.width

    def _key(self, beam: Beam) -> float:
        return score(beam, self.prompt, self.length_penalty, self.eos)

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """A round ran: per live beam (in :attr:`live`'s order), its likeliest next tokens
        and their log-probabilities. The next round's beams are kept, the ended ones
        collected; after the last round every beam has ended."""
        if len(tops) != len(self.live):
            raise ValueError(f"{len(tops)} rounds' alternatives for {len(self.live)} beams")
        grown: list[Beam] = []
        for beam, top in zip(self.live, tops, strict=True):
            for token, lp in top:
                tokens = (*beam.tokens, token)
                ended = self.ending(tokens)
                if ended is not None:
                    self.finished.append(Beam(tokens, beam.logprob + lp, *ended))
                else:
                    grown.append(Beam(tokens, beam.logprob + lp))
        grown.sort(key=self._key, reverse=True)  # stable: ties keep the tokens' order
        self.live = grown[: self.width]
        self.rounds += 1
        if self.rounds >= self.max_new:
            self.stop("length")

    def stop(self, reason: str) -> None:
        """End the search now: the live beams finish with ``reason``."""
        self.finished += [Beam(b.tokens, b.logprob, reason) for b in self.live]
        self.live = []

    def best(self) -> list[Beam]:
        """The ``width`` best beams, best first (the live ones count as they stand)."""
        every = self.finished + [Beam(b.tokens, b.logprob, "length") for b in self.live]
        return sorted(every, key=self._key, reverse=True)[: self.width]
