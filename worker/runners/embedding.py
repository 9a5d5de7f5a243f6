"""Sentence embeddings: mean of the last hidden state over real tokens, L2-normalised."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModel, PreTrainedModel

from .transformers_base import TransformersRunner


class EmbeddingRunner(TransformersRunner):
    """Options: ``normalize`` (default true)."""

    name = "embedding"

    def _load_model(self, path: str) -> PreTrainedModel:
        return AutoModel.from_pretrained(path, dtype=self.dtype)

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        hidden = model_out.last_hidden_state.float()
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        if self.options.get("normalize", True):
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        out: list[Any] = pooled.cpu().tolist()
        return out
