"""Model handlers on tiny random-weight models loaded from disk like real ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batchfleet.worker.handlers import resolve
from batchfleet.worker.handlers.classification import ClassificationHandler
from batchfleet.worker.handlers.embedding import EmbeddingHandler
from tiny_models import LABELS

TEXTS = [
    "the quick brown fox jumps over the lazy dog and then the dog jumps back",
    "hi",
    "what a day",
    "people work long and get little",
    "x",
]


def _max_diff(a: object, b: object) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


@pytest.fixture(scope="module")
def embedder(tiny_embedder: Path) -> EmbeddingHandler:
    return EmbeddingHandler(tiny_embedder, device="cpu", dtype="float32", max_tokens=48)


@pytest.fixture(scope="module")
def classifier(tiny_classifier: Path) -> ClassificationHandler:
    return ClassificationHandler(tiny_classifier, device="cpu", dtype="float32", max_tokens=48)


def test_embedding_batch_invariance(embedder: EmbeddingHandler) -> None:
    rows = embedder.encode(TEXTS)
    assert len({r.tokens for r in rows}) > 2, "needs mixed lengths to exercise padding"
    together = embedder.run(rows)
    for row, out in zip(rows, together, strict=True):
        assert _max_diff(out, embedder.run([row])[0]) <= 1e-4


def test_classification_batch_invariance(classifier: ClassificationHandler) -> None:
    rows = classifier.encode(TEXTS)
    together = classifier.run(rows)
    for row, out in zip(rows, together, strict=True):
        alone = classifier.run([row])[0]
        assert out["label"] == alone["label"]
        assert _max_diff(list(out["scores"].values()), list(alone["scores"].values())) <= 1e-4


def test_embeddings_are_normalised(embedder: EmbeddingHandler) -> None:
    for vec in embedder.run(embedder.encode(TEXTS)):
        assert abs(sum(x * x for x in vec) - 1.0) < 1e-4


def test_classification_outputs(classifier: ClassificationHandler) -> None:
    out = classifier.run(classifier.encode(["what a day"]))[0]
    assert set(out["scores"]) == set(LABELS.values())
    assert out["label"] == max(out["scores"], key=out["scores"].get)
    assert abs(sum(out["scores"].values()) - 1.0) < 1e-4


def test_truncation_is_reported_per_input(embedder: EmbeddingHandler) -> None:
    rows = embedder.encode(["the dog " * 200, "the dog"])
    assert [r.truncated for r in rows] == [True, False]
    assert rows[0].tokens == embedder.max_tokens == 48


def test_padding_is_to_the_longest_row_not_max_tokens(embedder: EmbeddingHandler) -> None:
    rows = embedder.encode(["hi", "what a day"])
    batch = embedder.collate(rows)
    assert batch["input_ids"].shape == (2, max(r.tokens for r in rows))


def test_max_tokens_is_capped_by_the_model(tiny_embedder: Path) -> None:
    h = EmbeddingHandler(tiny_embedder, device="cpu", max_tokens=10_000)
    assert h.max_tokens == 128  # max_position_embeddings of the tiny model


def test_resolve_handlers() -> None:
    assert resolve("embedding") is EmbeddingHandler
    assert resolve("text-classification") is ClassificationHandler
    assert resolve("batchfleet.worker.handlers.embedding:EmbeddingHandler") is EmbeddingHandler
    with pytest.raises(ValueError, match="unknown handler"):
        resolve("nonsense")


def test_no_cuda_request_fails_clearly(tiny_embedder: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        EmbeddingHandler(tiny_embedder, device="cuda")
