"""A beam-search request's rounds in the engine (:mod:`.beam` holds the search itself).

Each round, every live beam of each prompt is an engine sequence of one token (its prompt
and the beam's tokens) that keeps its ``2 * width`` likeliest alternatives; once every beam
of a prompt has its alternatives, that prompt's search advances and its next round is
added. The engine runs these sequences like any other (continuous batching with the other
requests, the prefix cache, the lane's priority), so its step loop does not change.

A round's sequence also draws its one token as a sampled sequence would, at the request's
``temperature`` (greedy at 0), and that token joins the alternatives with its
log-probability, as in vLLM, whose beam rounds keep the drawn token among their
log-probabilities. The alternatives' log-probabilities are the model's own (before
temperature, vLLM's default ``raw_logprobs``), so temperature changes no ranking: a drawn
token outside the ``2 * width`` likeliest can only end a beam (an end-of-sequence or stop
token: ``2 * width - 1`` likelier tokens of its own beam outrank it among the live ones).
With the request's ``seed`` each draw has its own seed (:func:`draw_seed`), so the same
request gives the same beams, after a preemption too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .beam import Beam, BeamSearch
from .engine import Engine, Output
from .sampling import Sampling


def draw_seed(seed: int | None, prompt: int, round_: int, beam: int) -> int | None:
    """The seed of a round's draw: one per prompt, round and live beam, from the request's
    ``seed`` (None: none, a random draw)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{prompt}:{round_}:{beam}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


@dataclass(slots=True)
class BeamRounds:
    """One request's beam searches (one per prompt) and their round's engine sequences."""

    key: str
    prompts: tuple[tuple[int, ...], ...]
    searches: list[BeamSearch]
    salt: str | None = None
    lora: int = 0
    lane: int = 0
    temperature: float = 0.0
    """Each round's draw (0: greedy, the likeliest token, already an alternative)."""
    seed: int | None = None
    """The request's: the draws' seeds (:func:`draw_seed`)."""
    pending: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The round's engine sequences: (prompt, beam) by sequence name."""
    tops: list[list[list[tuple[int, float]] | None]] = field(default_factory=list)
    """Per prompt, per live beam, its alternatives once its sequence has run."""
    cached: list[int] = field(default_factory=list)
    """Per prompt, the prompt tokens its first round took from the prefix cache."""
    added: int = 0
    """Sequences added so far (their names' serial: a name is never used twice)."""

    @property
    def done(self) -> bool:
        return all(s.done for s in self.searches)

    def start(self, engine: Engine) -> list[str]:
        """Add the round of every prompt whose search goes on and has none running; the
        names added. All or none: should an add raise, the sequences it added, the one
        that raised included, are taken back out of the engine (their KV blocks and
        sampler state freed), and a later call adds those rounds whole, under new names
        (a name is never used twice, so the engine's pending cancels cannot drop them)."""
        if not self.tops:
            self.tops = [[] for _ in self.searches]
            self.cached = [-1] * len(self.searches)
        running = {i for i, _ in self.pending.values()}
        names: list[str] = []
        try:
            for i, search in enumerate(self.searches):
                if search.done or i in running:
                    continue
                self.tops[i] = [None] * len(search.live)
                for k, beam in enumerate(search.live):
                    seed = draw_seed(self.seed, i, search.rounds, k)
                    sampling = Sampling(self.temperature, seed=seed, logprobs=search.alternatives)
                    name = f"{self.key}#beam{i}.{self.added}"
                    self.added += 1
                    self.pending[name] = (i, k)  # (first: an add that raises may have added it)
                    names.append(name)
                    engine.add(name, [*self.prompts[i], *beam.tokens], 1, sampling,
                               priority=self.lane, salt=self.salt, lora=self.lora)  # fmt: skip
        except BaseException:
            self._take_back(engine, names)
            raise
        return names

    def prefilled(self, engine: Engine, out: Output) -> int:
        """The prompt tokens a round's sequence prefilled, once its token came (``out``,
        before :meth:`took` forgets it): its prompt and its beam's tokens, less those it
        took from the prefix cache."""
        if not out.tokens:
            return 0
        i, k = self.pending[out.sequence]
        held = len(self.prompts[i]) + len(self.searches[i].live[k].tokens)
        return held - engine.cached(out.sequence)

    def took(self, engine: Engine, out: Output) -> bool:
        """A round's sequence ran (``out``): its alternatives kept, and its prompt's search
        advanced where it was the last of the round; whether one advanced."""
        i, k = self.pending.pop(out.sequence)
        kept = engine.logprobs(out.sequence)
        if self.cached[i] < 0:
            self.cached[i] = engine.cached(out.sequence)
        engine.forget(out.sequence)
        if not out.finished:  # (one token always ends it)
            engine.cancel([out.sequence])
        if not kept:
            raise RuntimeError(f"beam sequence {out.sequence}: the engine kept no alternatives")
        drawn, logprob, ids, values, _ = kept[0]
        tops = self.tops[i]
        alternatives = list(zip(ids, values, strict=True))
        if drawn not in ids:  # (sampled: it may be none of the likeliest)
            alternatives.append((drawn, logprob))
        tops[k] = alternatives
        if any(t is None for t in tops):
            return False
        self.searches[i].advance([t for t in tops if t is not None])
        self.tops[i] = []
        return True

    def cancel(self, engine: Engine) -> None:
        """Take the round's sequences out of the engine (their alternatives are lost: the
        round runs again when :meth:`start` is called)."""
        self._take_back(engine, list(self.pending))
        self.tops = [[] for _ in self.searches]

    def _take_back(self, engine: Engine, names: list[str]) -> None:
        """Take these round sequences out of the engine and forget them."""
        engine.cancel(names)
        for name in names:
            engine.forget(name)
            self.pending.pop(name, None)

    def stop(self, reason: str) -> None:
        """End every search now (cancelled, past its deadline)."""
        for s in self.searches:
            if not s.done:
                s.stop(reason)

    def best(self) -> list[Beam]:
        """The outputs: each prompt's ``width`` best beams, prompt by prompt."""
        return [b for s in self.searches for b in s.best()]

    def contexts(self) -> tuple[tuple[int, ...], int]:
        """Per live beam, the tokens it holds in the KV cache when its round runs; and the
        most rounds any search has left."""
        ctx = tuple(len(self.prompts[i]) + len(b.tokens)
                    for i, s in enumerate(self.searches) for b in s.live)  # fmt: skip
        left = max((s.max_new - s.rounds for s in self.searches if not s.done), default=0)
        return ctx, left
