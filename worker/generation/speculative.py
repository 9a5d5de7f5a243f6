"""Speculative decoding by n-gram lookup (vLLM's ``method = "ngram"``, prompt lookup).

A decoding sequence whose context (prompt and output) ends with an n-gram seen earlier in
it proposes the tokens that followed that earlier occurrence as drafts: summaries, edits
and extractions repeat their prompt's text, code repeats itself. The padded engine
verifies a row's drafts in the same forward as its decode (:mod:`.padded`) and keeps the
longest prefix the model agrees with, plus one token of its own, so one step may emit
up to ``num_speculative_tokens + 1`` tokens for the cost of a slightly wider forward.

The match (vLLM's ``NgramProposer``): the longest n-gram between ``prompt_lookup_min``
and ``prompt_lookup_max`` that ends the context and occurs earlier in it, at its first
occurrence; the drafts are up to ``num_speculative_tokens`` tokens after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

METHODS = ("ngram",)
"""The proposal methods served."""


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """``options.speculative`` of a text-generation model (vLLM's ``speculative_config``)."""

    num_speculative_tokens: int
    """The most drafts a sequence proposes per step (vLLM's ``k``)."""
    prompt_lookup_min: int = 1
    """The shortest n-gram matched."""
    prompt_lookup_max: int = 4
    """The longest n-gram matched (the longest found wins)."""

    @classmethod
    def parse(cls, raw: Any) -> NgramConfig:
        """The fleet file's table, checked (a ``ValueError`` says what is wrong)."""
        where = "options.speculative"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: a table such as {{method = \"ngram\", "
                             "num_speculative_tokens = 4}")  # fmt: skip
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
        method = raw.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"{where}.method: {method!r} is not one of {', '.join(METHODS)} "
                             "(a draft model is not served)")  # fmt: skip
        values = {}
        for name, low, default in (("num_speculative_tokens", 1, None),
                                   ("prompt_lookup_min", 1, 1),
                                   ("prompt_lookup_max", 1, 4)):  # fmt: skip
            v = raw.get(name, default)
            if v is None:
                raise ValueError(f"{where}.{name} is required")
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= 64:
                raise ValueError(f"{where}.{name}: {v!r} is not an integer in {low} … 64")
            values[name] = v
        if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
            raise ValueError(f"{where}: prompt_lookup_min {values['prompt_lookup_min']} exceeds "
                             f"prompt_lookup_max {values['prompt_lookup_max']}")  # fmt: skip
        return cls(**values)

    def propose(self, context: Sequence[int], limit: int) -> list[int]:
        """At most ``min(limit, num_speculative_tokens)`` drafts to follow ``context``
        (module docstring; empty: no match)."""
        k = min(limit, self.num_speculative_tokens)
        n = len(context)
        if k <= 0 or n <= self.prompt_lookup_min:
            return []
        return ngram_drafts(np.asarray(context, dtype=np.int64), self.prompt_lookup_min,
                            self.prompt_lookup_max, k)  # fmt: skip


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
