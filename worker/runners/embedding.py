"""Sentence embeddings: the last hidden state pooled over real tokens (mean, the first
token's or the last token's), L2-normalised."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModel, PreTrainedModel

from .transformers_base import TransformersRunner

POOLINGS = ("mean", "cls", "last")
"""Option ``pooling``: vLLM's ``MEAN``, ``CLS`` and ``LAST`` sequence pooling."""


class EmbeddingRunner(TransformersRunner):
    """Options: ``pooling`` (``mean``, the default; ``cls``: the first token, as BERT-style
    models trained with it; ``last``: the last real token, as decoder embedding models),
    ``normalize`` (default true)."""

    name = "embedding"

    def _load_model(self, path: str) -> PreTrainedModel:
        pooling = self.options.get("pooling", "mean")
        if pooling not in POOLINGS:
            raise ValueError(f"option pooling must be one of {POOLINGS}, not {pooling!r}")
        return AutoModel.from_pretrained(path, dtype=self.dtype)

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        hidden = model_out.last_hidden_state.float()
        pooling = self.options.get("pooling", "mean")
        if pooling == "cls":
            pooled = hidden[:, 0]
        elif pooling == "last":  # rows are padded on the right
            last = (mask.sum(dim=1) - 1).clamp(min=0).to(torch.long)
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        if self.options.get("normalize", True):
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        out: list[Any] = pooled.cpu().tolist()
        return out
