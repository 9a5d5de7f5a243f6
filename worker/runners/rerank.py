"""Cross-encoder reranking: one relevance score per (query, document) pair.

Inputs are text pairs (``{"text": query, "text_pair": document}``: one score each, in
order) or rankings (``{"query": …, "documents": […], "top_n": n}``: one model row per
document, answered as one output, ``[{"index": i, "score": s}, …]`` best first). Option
``activation``: ``none`` (raw logit, default) or ``sigmoid``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from ...schemas.inputs import Ranking
from ...schemas.messages import Request
from ..runner import Encoded
from .transformers_base import TransformersRunner

ACTIVATIONS = ("none", "sigmoid")


@dataclass(frozen=True, slots=True)
class Span:
    """The rows of one input: ``count`` of them; ``top_n`` set for a ranking."""

    count: int
    ranking: bool
    top_n: int | None


class RankedRows(list[Encoded]):
    """A request's rows, and which input each span of them belongs to."""

    spans: tuple[Span, ...] = ()


class RerankRunner(TransformersRunner):
    """``AutoModelForSequenceClassification`` with one output (a relevance logit)."""

    name = "rerank"
    accepts = frozenset({"pair", "ranking"})

    def _load_model(self, path: str) -> PreTrainedModel:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=self.dtype)
        if model.config.num_labels != 1:
            raise ValueError(
                f"{path}: a rerank model has one output (num_labels 1), "
                f"not {model.config.num_labels}"
            )
        activation = self.options.get("activation", "none")
        if activation not in ACTIVATIONS:
            raise ValueError(f"option activation must be one of {ACTIVATIONS}, not {activation!r}")
        return model

    def _outputs(self, model_out: Any, mask: torch.Tensor) -> list[Any]:
        scores = model_out.logits.float()[:, 0]
        if self.options.get("activation", "none") == "sigmoid":
            scores = torch.sigmoid(scores)
        out: list[Any] = scores.cpu().tolist()
        return out

    def payload(self, request: Request, rows: list[Any]) -> Sequence[Any]:
        if not any(isinstance(i, Ranking) for i in request.inputs):
            return rows
        ranked = RankedRows(rows)
        ranked.spans = tuple(
            Span(len(i.documents), True, i.top_n)
            if isinstance(i, Ranking)
            else Span(1, False, None)
            for i in request.inputs
        )
        return ranked

    def assemble(self, payload: Sequence[Any], outputs: list[Any]) -> list[Any]:
        if not isinstance(payload, RankedRows):
            return outputs
        out: list[Any] = []
        pos = 0
        for span in payload.spans:
            scores = outputs[pos : pos + span.count]
            pos += span.count
            if not span.ranking:
                out.append(scores[0])
                continue
            order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
            out.append([{"index": i, "score": scores[i]} for i in order[: span.top_n]])
        return out
