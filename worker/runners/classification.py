"""Text classification: label, score and every label's probability for each input."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from .transformers_base import TransformersRunner


def label_scores(logits: torch.Tensor, config: Any) -> list[dict[str, Any]]:
    """``{"label", "score", "scores"}`` per row: softmax over labels (sigmoid per label for
    multi-label models)."""
    logits = logits.float()
    multi = getattr(config, "problem_type", None) == "multi_label_classification"
    probs = torch.sigmoid(logits) if multi else torch.softmax(logits, dim=-1)
    labels: dict[Any, str] = dict(config.id2label or {})
    out = []
    for row in probs.cpu().tolist():
        best = max(range(len(row)), key=row.__getitem__)
        out.append(
            {
                "label": labels[best],
                "score": row[best],
                "scores": {labels[i]: p for i, p in enumerate(row)},
            }
        )
    return out


class ClassificationRunner(TransformersRunner):
    """Softmax over labels (sigmoid per label for multi-label models). Takes texts, and text
    pairs (``{"text", "text_pair"}``: NLI, paraphrase...)."""

    name = "text-classification"
    accepts = frozenset({"text", "pair"})

    def _load_model(self, path: str) -> PreTrainedModel:
        return AutoModelForSequenceClassification.from_pretrained(path, dtype=self.dtype)

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        return label_scores(model_out.logits, self.model.config)
