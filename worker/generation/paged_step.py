"""What the paged engine (:mod:`.paged`) adds to one step's forward: its sequences' LoRA
adapters, and the logits of the prompt positions a scoring sequence asks for.

transformers' paged step runs one forward over one batch row: every scheduled sequence's
tokens side by side (a prefill chunk's, a decode's one), and the LM head only where a
sequence takes its next token (``logits_indices``). Before the forward, :func:`plan`
reads the scheduled batch and says

- per token, its sequence's adapter (:mod:`.lora_hooks` with ``tokens=True``), and
- which tokens' logits to keep beside those: the positions of a scoring sequence's chunk
  whose next token is a prompt token, each position once (a chunk run again after a
  reset is not scored twice).

:class:`ScoringForward` stands in for the model in that forward: it asks the model for
the logits of the next-token rows and of those positions (``logits_to_keep``, so they go
through the model's own head: soft-capping and scales included), hands the step the
former and keeps the latter. There is no prefix sharing in this engine (transformers'
block sharing is off), so every position of a prompt is prefilled here and scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling import Logprob, logprob_rows


@dataclass(slots=True)
class Scored:
    """A sequence whose prompt tokens' log-probabilities are kept."""

    tokens: list[int]
    top: int
    """The likeliest tokens kept per position."""
    kept: list[Logprob] = field(default_factory=list)
    """Per prompt token after the first, so far: ``kept[i]`` is token ``i + 1``'s."""

    @property
    def done(self) -> bool:
        return len(self.kept) >= len(self.tokens) - 1


@dataclass(slots=True)
class StepPlan:
    """What one step's forward adds (:func:`plan`)."""

    labels: list[int]
    """Per token of the forward (its padding too), its adapter (0: none)."""
    positions: list[int]
    """The forward's tokens whose logits score a prompt token, in order."""
    spans: list[tuple[Scored, int, int]]
    """Per scored chunk, its sequence and the prompt positions ``[start, end)`` it scores:
    ``end - start`` of ``positions``, in the same order."""

    @property
    def adapted(self) -> bool:
        return any(self.labels)


def plan(batch: list[Any], tokens: int, adapters: dict[str, int],
         scored: dict[str, Scored]) -> StepPlan | None:  # fmt: skip
    """What the scheduled ``batch`` (transformers' ``FutureRequestState`` list, its
    positions advanced past this step's chunks; ``tokens``: the forward's length, padding
    included) needs beyond the plain step, from the sequences' ``adapters`` (labels) and
    those being ``scored``; None: nothing."""
    labels: list[int] = []
    positions: list[int] = []
    spans: list[tuple[Scored, int, int]] = []
    at = 0
    for future in batch:
        name, q = future.state.request_id, future.query_length
        past = future.state.position_offset - q
        labels += [adapters.get(name, 0)] * q
        s = scored.get(name)
        if s is not None and not s.done:
            start, end = len(s.kept), min(past + q, len(s.tokens) - 1)
            if start < past:  # a chunk went unscored: the scores would be misplaced
                raise RuntimeError(f"prompt log-probabilities of {name}: positions "
                                   f"{start}-{past - 1} were prefilled unscored")  # fmt: skip
            if start < end:
                positions += range(at + start - past, at + end - past)
                spans.append((s, start, end))
        at += q
    if not spans and not any(labels):
        return None
    return StepPlan(labels + [0] * (tokens - len(labels)), positions, spans)


def keep_scores(step: StepPlan, logits: torch.Tensor) -> None:
    """Each scored chunk's log-probabilities from ``logits`` (one row per ``positions``)."""
    at = 0
    for s, start, end in step.spans:
        n = end - start
        s.kept += logprob_rows(logits[at : at + n], s.tokens[start + 1 : end + 1], s.top)
        at += n


class ScoringForward:
    """The model as transformers' step calls it (``model(**batch)``), also computing the
    logits at ``positions`` of the forward's tokens (kept in :attr:`scored`)."""

    def __init__(self, model: Any, positions: list[int]) -> None:
        self.model = model
        self.positions = positions
        self.scored: torch.Tensor | None = None

    def _supports_logits_to_keep(self) -> bool:
        """What transformers' step asks of the model it calls (whether it slices the
        hidden states before the head)."""
        probe = getattr(self.model, "_supports_logits_to_keep", None)
        return bool(callable(probe) and probe())

    def __call__(self, **batch: Any) -> Any:
        keep = batch.get("logits_to_keep")
        at = torch.tensor(self.positions, dtype=torch.long, device=batch["input_ids"].device)
        if not isinstance(keep, torch.Tensor):  # no slicing: every token's logits come back
            out = self.model(**batch)
            self.scored = out.logits[0, at]
            return out
        n = keep.shape[0]
        out = self.model(**{**batch, "logits_to_keep": torch.cat([keep.to(at.dtype), at])})
        self.scored = out.logits[0, n:]
        out.logits = out.logits[:, :n]
        return out
