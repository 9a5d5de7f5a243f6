"""Sentence embeddings: the last hidden state pooled over real tokens (mean, the first
token's, the last token's, or GritLM's mean after its instruction), L2-normalised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModel, PreTrainedModel

from ...schemas.inputs import AnyInput
from ..runner import Encoded, InvalidInput
from .gritlm import GritInstruction, load_bidirectional
from .transformers_base import TransformersRunner

POOLINGS = ("mean", "cls", "last", "gritlm")
"""Option ``pooling``: vLLM's ``MEAN``, ``CLS`` and ``LAST`` sequence pooling, and its
GritLM pooler (:mod:`.gritlm`)."""


class EmbeddingRunner(TransformersRunner):
    """Options: ``pooling`` (``mean``, the default; ``cls``: the first token, as BERT-style
    models trained with it; ``last``: the last real token, as decoder embedding models;
    ``gritlm``: GritLM's, the mean after the prompt's instruction, its attention
    bidirectional, as vLLM's GritLM pooler), ``normalize`` (default true)."""

    name = "embedding"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grit = (
            GritInstruction(self._tok.token_to_id)
            if self.options.get("pooling") == "gritlm"
            else None
        )

    def _load_model(self, path: str) -> PreTrainedModel:
        pooling = self.options.get("pooling", "mean")
        if pooling not in POOLINGS:
            raise ValueError(f"option pooling must be one of {POOLINGS}, not {pooling!r}")
        if pooling == "gritlm":
            return load_bidirectional(path, self.dtype)
        return AutoModel.from_pretrained(path, dtype=self.dtype)

    def encode(self, inputs: Sequence[AnyInput]) -> list[Encoded]:
        """As the base's; with ``gritlm`` pooling, a text that is all instruction (nothing
        to average: vLLM's vector would be NaN) is refused."""
        rows = super().encode(inputs)
        if self._grit is not None and any(self._grit.length(r.ids) >= r.tokens for r in rows):
            raise InvalidInput("nothing to embed after the instruction (<|embed|>\\n)")
        return rows

    def _pooled_mask(self, rows: Sequence[Encoded], mask: torch.Tensor) -> torch.Tensor:
        if self._grit is None:
            return mask
        starts = torch.tensor([self._grit.length(r.ids) for r in rows], device=mask.device)
        after = torch.arange(mask.shape[1], device=mask.device)[None, :] >= starts[:, None]
        return mask * after.to(mask.dtype)

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        hidden = model_out.last_hidden_state.float()
        pooling = self.options.get("pooling", "mean")
        if pooling == "cls":
            pooled = hidden[:, 0]
        elif pooling == "last":  # rows are padded on the right
            last = (mask.sum(dim=1) - 1).clamp(min=0).to(torch.long)
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        else:  # mean, gritlm (its mask: the tokens after the instruction)
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        if self.options.get("normalize", True):
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        out: list[Any] = pooled.cpu().tolist()
        return out
