"""Per-request sampling with per-request seeds, inside transformers' continuous batching.

transformers' continuous batching samples with one global generator, so a request's text
would depend on its batch-mates. We run it greedy (``do_sample=False``) and put this
processor in its logits-processor list: for each row of a sampling request it applies
temperature, top-k and top-p, draws a token with that request's own generator, and leaves
only that token's logit finite — the engine's argmax then picks it. Greedy rows (no
temperature, or 0) pass through untouched. The same request with the same seed therefore
gives the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling parameters (``temperature`` 0: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class SeededSampler(ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
    """Samples each sequence with its own generator (see the module docstring)."""

    supported_kwargs: dict[str, type] = {}  # rows are known by request id
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._sampling: dict[str, tuple[Sampling, torch.Generator]] = {}
        self._rows: list[str] = []

    def add(self, sequence: str, sampling: Sampling) -> None:
        """Register a sequence before it is scheduled (greedy ones need nothing). A
        sequence resumed after preemption keeps its generator, so its draws go on."""
        if sampling.greedy or sequence in self._sampling:
            return
        seed = (
            sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        self._sampling[sequence] = (sampling, gen)

    def forget(self, sequence: str) -> None:
        """The sequence ended."""
        self._sampling.pop(sequence, None)

    def draw(self, sequence: str, logits: torch.Tensor) -> int | None:
        """A sampling sequence's next token from its ``logits`` row (None: greedy)."""
        entry = self._sampling.get(sequence)
        return None if entry is None else sample(logits, *entry)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        # The rows of the next __call__ are these requests, in this order.
        self._rows = [r.state.request_id for r in requests_with_new_token]
        return torch.zeros(len(self._rows), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not self._sampling:
            return scores
        for row, sequence in enumerate(self._rows[: scores.shape[0]]):
            entry = self._sampling.get(sequence)
            if entry is None:
                continue
            sampling, gen = entry
            token = sample(scores[row], sampling, gen)
            scores[row].fill_(float("-inf"))
            scores[row, token] = 0.0
        return scores


def sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    """One token from ``logits`` (1-D) by temperature, top-k and top-p, drawn with ``gen``."""
    x = logits.float().cpu() / max(sampling.temperature, 1e-5)
    if 0 < sampling.top_k < x.shape[0]:
        kth = torch.topk(x, sampling.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > sampling.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())
