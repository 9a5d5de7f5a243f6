"""Text classification: label, score and every label's probability for each input."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from .transformers_base import TransformersRunner


class ClassificationRunner(TransformersRunner):
    """Softmax over labels (sigmoid per label for multi-label models)."""

    name = "text-classification"

    def _load_model(self, path: str) -> PreTrainedModel:
        return AutoModelForSequenceClassification.from_pretrained(path, dtype=self.dtype)

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        logits = model_out.logits.float()
        multi = getattr(self.model.config, "problem_type", None) == "multi_label_classification"
        probs = torch.sigmoid(logits) if multi else torch.softmax(logits, dim=-1)
        labels: dict[Any, str] = dict(self.model.config.id2label or {})
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
