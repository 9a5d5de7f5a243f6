"""Speculative decoding with a draft model (vLLM's ``method = "draft_model"``).

A smaller causal LM of the target's vocabulary proposes each decoding row's drafts: it
reads the row's context (prompt and output) and picks its argmax ``k`` times, one token
a forward, as vLLM's draft proposer does (greedy drafts: the engine verifies them as it
verifies n-gram ones, a draft of probability one, so greedy rows emit exactly their
tokens without speculation and sampled rows keep the target's distribution).

Its KV cache: one growing cache per running sequence (:class:`.padded.SlabLayer`, which
appends in place and grows by doubling), not a padded batch like the target's. Each
proposal first lines it up with the row's context: it keeps the longest prefix of the
tokens it holds that the context starts with (the drafts the target accepted stay; those
it rejected, and the last draft's column, go: a crop is a view, nothing is copied), then
runs the rest of the context (the prompt when the sequence first proposes; afterwards
the step's bonus token, one token). Tracking the tokens, not the counts, keeps the cache
right whatever happened since (a preempted sequence added again, a stop token among the
drafts). Why not a batch of rows: the rows' contexts differ in length each step by their
accepted drafts, and a padded batch would need the engine's per-row write positions in a
second model; a draft model is small, and its per-row forwards stay out of the target's
path. A prompt is prefilled in chunks of at most ``chunk`` tokens a step (the row
proposes nothing until its prompt is in).

Memory: a sequence's draft cache holds at most its context plus ``k - 1`` drafts, and the
engine asks for no more drafts than the row may still generate, so it never holds more
tokens than the target's row may (the model's context); at most ``max_running`` of them
(the running rows'), each dropped when its row leaves the batch (:meth:`retain`, after
every step). Its bytes per token are the draft's own (layers x 2 x KV heads x head size
x dtype), ``tokens`` counts them (the runner's ``info()``: ``draft_kv_tokens``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from .padded import SlabLayer
from .speculative import DraftConfig

logger = logging.getLogger(__name__)


def vocab_size(model: Any) -> int:
    """A causal LM's vocabulary: its config's, else its output embedding's rows."""
    size = getattr(model.config.get_text_config(), "vocab_size", None)
    return int(size) if size else int(model.get_output_embeddings().weight.shape[0])


def load(config: DraftConfig, target: Any, chunk: int) -> DraftProposer:
    """The draft model of ``config`` on ``target``'s device and dtype, checked: a
    ``ValueError`` where its vocabulary is not the target's (its token ids would mean
    other tokens)."""
    from transformers import AutoModelForCausalLM

    param = next(target.parameters())
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=param.dtype)
    mine, theirs = vocab_size(model), vocab_size(target)
    if mine != theirs:
        raise ValueError(f"options.speculative.model: the draft model's vocabulary has "
                         f"{mine} tokens and the target's {theirs}: they must be the "
                         "same")  # fmt: skip
    return DraftProposer(model.to(param.device).eval(), config, chunk)


@dataclass(slots=True)
class _Kept:
    """A sequence's draft cache and the tokens it holds, in order."""

    cache: Cache
    tokens: list[int] = field(default_factory=list)


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: nothing was rejected
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


class DraftProposer:
    """Proposes drafts with a draft model (module docstring); one engine's, its thread's."""

    def __init__(self, model: Any, config: DraftConfig, chunk: int = 512) -> None:
        self.model = model
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.chunk = max(1, chunk)
        """The most context tokens a sequence's draft cache takes in one step."""
        self.device = next(model.parameters()).device
        self.max_positions = int(
            getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 1 << 62
        )
        """The draft's longest context: no draft is proposed past it."""
        self._kept: dict[str, _Kept] = {}

    @property
    def tokens(self) -> int:
        """Tokens the draft caches hold (their memory: module docstring)."""
        return sum(len(k.tokens) for k in self._kept.values())

    def settings(self) -> dict[str, Any]:
        return {"method": "draft_model", "model": self.config.model,
                "num_speculative_tokens": self.num_speculative_tokens}  # fmt: skip

    def retain(self, sequences: Iterable[str]) -> None:
        """Drop the draft caches of every sequence but these (the running ones)."""
        keep = set(sequences)
        for name in [n for n in self._kept if n not in keep]:
            del self._kept[name]

    def propose(self, context: Sequence[int], limit: int, sequence: str = "") -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` greedy drafts to follow
        ``sequence``'s ``context`` (none while its prompt is still going into its draft
        cache, or past the draft's longest context)."""
        k = min(limit, self.num_speculative_tokens, self.max_positions - len(context) + 1)
        if k <= 0 or not context:
            return []
        kept = self._kept.get(sequence)
        if kept is None:
            layer = functools.partial(SlabLayer, reserve=len(context) + k)
            kept = self._kept[sequence] = _Kept(Cache(layer_class_to_replicate=layer))
        # the context's last token always runs: its logits give the first draft
        self._crop(kept, min(common(kept.tokens, context), len(context) - 1))
        rest = list(context[len(kept.tokens) :])
        if len(rest) > self.chunk:
            self._forward(kept, rest[: self.chunk])
            return []
        logits = self._forward(kept, rest)
        drafts: list[int] = []
        while True:
            drafts.append(int(logits.argmax()))
            if len(drafts) == k:
                return drafts
            logits = self._forward(kept, drafts[-1:])

    def _crop(self, kept: _Kept, n: int) -> None:
        """The cache keeps its first ``n`` tokens (views: the columns after are written
        over by the next forward)."""
        if n == len(kept.tokens):
            return
        for layer in kept.cache.layers:
            if layer.keys is not None:
                layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        del kept.tokens[n:]

    def _forward(self, kept: _Kept, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` after what ``kept`` holds; the last one's logits."""
        start = len(kept.tokens)
        positions = torch.arange(start, start + len(tokens), device=self.device)
        logits = self.model(
            input_ids=torch.tensor([tokens], device=self.device), position_ids=positions[None],
            cache=kept.cache, use_cache=True, logits_to_keep=1,
        ).logits[0, -1]  # fmt: skip
        kept.tokens += tokens
        return logits
