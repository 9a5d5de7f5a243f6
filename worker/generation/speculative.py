"""Speculative decoding's options, and its n-gram proposer (vLLM's ``method = "ngram"``,
prompt lookup); the draft-model proposer (``method = "draft_model"``) is :mod:`.draft`.

A decoding sequence whose context (prompt and output) ends with an n-gram seen earlier in
it proposes the tokens that followed that earlier occurrence as drafts: summaries, edits
and extractions repeat their prompt's text, code repeats itself. The padded engine
verifies a row's drafts in the same forward as its decode (:mod:`.padded`) and keeps the
longest prefix the model agrees with, plus one token of its own, so one step may emit
up to ``num_speculative_tokens + 1`` tokens for the cost of a slightly wider forward.

The match (vLLM's ``NgramProposer``): the longest n-gram between ``prompt_lookup_min``
and ``prompt_lookup_max`` that ends the context and occurs earlier in it, at its first
occurrence; the drafts are up to ``num_speculative_tokens`` tokens after it.

Either proposer drafts fewer, or none, in steps where many sequences run (vLLM's
``disable_by_batch_size`` and ``num_speculative_tokens_per_batch_size``: :mod:`.spec_bound`);
vLLM's other ``SpeculativeConfig`` keys are taken as they are or refused with why
(:mod:`.spec_keys`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import spec_keys
from .spec_bound import KEYS as BOUND_KEYS
from .spec_bound import NO_BOUND, BatchBound

METHODS = ("ngram", "draft_model")
"""The proposal methods served."""
WHERE = "options.speculative"
LOOKUP_DEFAULT = 5
"""``prompt_lookup_min`` and ``prompt_lookup_max`` where neither is given (vLLM's)."""
LOOKUP_KEYS = ("prompt_lookup_min", "prompt_lookup_max")

Row = tuple[str, Sequence[int], int]
"""A decoding row asking for drafts: its sequence, its context (prompt and output), and
the most drafts it may take (what it may still generate after the step's own token)."""


class Proposer(Protocol):
    """What the padded engine asks of a speculative proposer, before each step."""

    def propose(self, rows: Sequence[Row], budget: int) -> list[list[int]]:
        """Per row, in order, its drafts: at most its limit, and at most ``budget`` in all
        (the earlier rows first)."""
        ...

    def retain(self, sequences: Iterable[str]) -> None:
        """Only these sequences still run: drop what is kept for any other."""
        ...

    def settings(self) -> dict[str, Any]:
        """Its options as the runner's ``info()`` shows them (``method`` first)."""
        ...

    def limit(self, running: int) -> int:
        """The most drafts a row may propose in a step where ``running`` sequences run
        (0: none; :mod:`.spec_bound`)."""
        ...


def parse(raw: Any) -> NgramConfig | DraftConfig:
    """The fleet file's ``options.speculative`` table, checked (a ``ValueError`` says what
    is wrong). Without ``method``: ``draft_model`` where it names a ``model`` (as vLLM
    infers it), else ``ngram``."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{WHERE}: a table such as {{method = \"ngram\", "
                         "num_speculative_tokens = 4}")  # fmt: skip
    method = raw.get("method", "draft_model" if "model" in raw else "ngram")
    if method not in METHODS:
        raise ValueError(f"{WHERE}.method: {method!r} is not one of {', '.join(METHODS)}")
    return NgramConfig.parse(raw) if method == "ngram" else DraftConfig.parse(raw)


def _known(raw: Mapping[str, Any], own: set[str]) -> BatchBound:
    """Refuse a key no method takes, or another method's (vLLM's other keys are judged by
    :func:`.spec_keys.check`); the batch-size bound (:class:`.BatchBound`)."""
    known = own | {"method", "num_speculative_tokens", *BOUND_KEYS, *spec_keys.check(raw)}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"{WHERE}: unknown keys {unknown} (known: {sorted(known)})")
    return BatchBound.parse(raw)


def _count(raw: Mapping[str, Any], name: str, default: int | None) -> int:
    """Key ``name`` of ``raw`` (``default`` where absent; None: required), an integer
    in 1 … 64."""
    v = raw.get(name, default)
    if v is None:
        raise ValueError(f"{WHERE}.{name} is required")
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
        raise ValueError(f"{WHERE}.{name}: {v!r} is not an integer in 1 … 64")
    return v


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """``options.speculative`` with ``method = "draft_model"``: a smaller causal LM of the
    same vocabulary proposes the drafts (:mod:`.draft`)."""

    model: str
    """The draft model's directory (vLLM's ``model``)."""
    num_speculative_tokens: int
    """The most drafts a sequence proposes per step (vLLM's ``k``)."""
    bound: BatchBound = NO_BOUND
    """Fewer drafts, or none, in steps where many sequences run."""
    max_model_len: int | None = None
    """No drafts past this many tokens of context (vLLM's: at most the draft's
    ``max_position_embeddings`` and the target's context, checked at load; None: the
    draft's ``max_position_embeddings``)."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> DraftConfig:
        """The table, checked (a ``ValueError`` says what is wrong)."""
        bound = _known(raw, {"model", "max_model_len"})
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{WHERE}.model: the draft model's directory is required "
                             f"(got {model!r})")  # fmt: skip
        most = raw.get("max_model_len")
        if most is not None and (not isinstance(most, int) or isinstance(most, bool) or most < 1):
            raise ValueError(f"{WHERE}.max_model_len: {most!r} is not a positive integer")
        return cls(model, _count(raw, "num_speculative_tokens", None), bound, most)


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """``options.speculative`` of a text-generation model (vLLM's ``speculative_config``)."""

    num_speculative_tokens: int
    """The most drafts a sequence proposes per step (vLLM's ``k``)."""
    prompt_lookup_min: int = 5
    """The shortest n-gram matched (vLLM's default where neither bound is given:
    :data:`LOOKUP_DEFAULT`)."""
    prompt_lookup_max: int = 5
    """The longest n-gram matched (the longest found wins)."""
    bound: BatchBound = NO_BOUND
    """Fewer drafts, or none, in steps where many sequences run."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> NgramConfig:
        """The table (its ``method`` ``ngram``, or none), checked (a ``ValueError`` says
        what is wrong)."""
        if "max_model_len" in raw:
            raise ValueError(f"{WHERE}.max_model_len bounds a draft model's context, and the "
                             "ngram method has none (vLLM ignores it there)")  # fmt: skip
        bound = _known(raw, set(LOOKUP_KEYS))
        tokens = _count(raw, "num_speculative_tokens", None)
        # vLLM's SpeculativeConfig: both LOOKUP_DEFAULT where neither is given, else the
        # one given stands for the other
        given = {k: _count(raw, k, None) for k in LOOKUP_KEYS if raw.get(k) is not None}
        low = given.get("prompt_lookup_min", given.get("prompt_lookup_max", LOOKUP_DEFAULT))
        high = given.get("prompt_lookup_max", low)
        if low > high:
            raise ValueError(f"{WHERE}: prompt_lookup_min={low} must be <= "
                             f"prompt_lookup_max={high}")  # fmt: skip
        return cls(tokens, low, high, bound)

    def propose(self, rows: Sequence[Row], budget: int) -> list[list[int]]:
        """Each row's drafts (:meth:`drafts`), the earlier rows first while ``budget``
        lasts."""
        out: list[list[int]] = []
        for _, context, limit in rows:
            d = self.drafts(context, min(limit, budget)) if budget > 0 else []
            budget -= len(d)
            out.append(d)
        return out

    def drafts(self, context: Sequence[int], limit: int) -> list[int]:
        """At most ``min(limit, num_speculative_tokens)`` drafts to follow ``context``
        (module docstring; empty: no match)."""
        k = min(limit, self.num_speculative_tokens)
        n = len(context)
        if k <= 0 or n <= self.prompt_lookup_min:
            return []
        return ngram_drafts(np.asarray(context, dtype=np.int64), self.prompt_lookup_min,
                            self.prompt_lookup_max, k)  # fmt: skip

    def retain(self, sequences: Iterable[str]) -> None:
        """Nothing is kept per sequence."""

    def settings(self) -> dict[str, Any]:
        return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max, **self.bound.settings()}  # fmt: skip

    def limit(self, running: int) -> int:
        return self.bound.limit(running, self.num_speculative_tokens)


def ngram_drafts(tokens: np.ndarray, low: int, high: int, k: int) -> list[int]:
    """The ``k`` tokens after the first earlier occurrence of the longest suffix of
    ``tokens`` of ``low`` to ``high`` tokens that occurs earlier (fewer where the context
    ends sooner; empty: none occurs)."""
    n = len(tokens)
    ends = n - 1  # an occurrence ends at e < n - 1, so a token follows it
    if ends < low:
        return []
    # matched[e]: how many tokens before and at e equal the context's last ones
    matched = np.zeros(ends, dtype=np.int64)
    run = np.ones(ends, dtype=bool)
    for t in range(min(high, ends)):
        e = np.arange(t, ends)
        same = np.zeros(ends, dtype=bool)
        same[t:] = tokens[e - t] == tokens[n - 1 - t]
        run &= same
        if not run.any():
            break
        matched += run
    best = int(matched.max())
    if best < low:
        return []
    at = int(np.argmax(matched == best))
    return [int(t) for t in tokens[at + 1 : at + 1 + k]]
