"""Runners on tiny random-weight models loaded from disk like real ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batchfleet.worker.runners import resolve
from batchfleet.worker.runners.classification import ClassificationRunner
from batchfleet.worker.runners.embedding import EmbeddingRunner
from devices import DEVICE
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
def embedder(tiny_embedder: Path) -> EmbeddingRunner:
    return EmbeddingRunner(tiny_embedder, device=DEVICE, dtype="float32", max_tokens=48)


@pytest.fixture(scope="module")
def classifier(tiny_classifier: Path) -> ClassificationRunner:
    return ClassificationRunner(tiny_classifier, device=DEVICE, dtype="float32", max_tokens=48)


def test_embedding_batch_invariance(embedder: EmbeddingRunner) -> None:
    rows = embedder.encode(TEXTS)
    assert len({r.tokens for r in rows}) > 2, "needs mixed lengths to exercise padding"
    together = embedder.run(rows)
    for row, out in zip(rows, together, strict=True):
        assert _max_diff(out, embedder.run([row])[0]) <= 1e-4


def test_classification_batch_invariance(classifier: ClassificationRunner) -> None:
    rows = classifier.encode(TEXTS)
    together = classifier.run(rows)
    for row, out in zip(rows, together, strict=True):
        alone = classifier.run([row])[0]
        assert out["label"] == alone["label"]
        assert _max_diff(list(out["scores"].values()), list(alone["scores"].values())) <= 1e-4


def test_embeddings_are_normalised(embedder: EmbeddingRunner) -> None:
    for vec in embedder.run(embedder.encode(TEXTS)):
        assert abs(sum(x * x for x in vec) - 1.0) < 1e-4


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_embedding_pooling_option_pools_the_model_states(tiny_embedder: Path, pooling: str) -> None:
    """Each row of a padded batch is pooled over its own tokens as the option says (the
    first token, the last real one, the mean of the real ones), as the model alone gives."""
    from transformers import AutoModel, AutoTokenizer

    options = {"pooling": pooling, "normalize": False}
    runner = EmbeddingRunner(tiny_embedder, device="cpu", dtype="float32", max_tokens=48,
                             options=options)  # fmt: skip
    got = runner.run(runner.encode(TEXTS))
    model = AutoModel.from_pretrained(tiny_embedder).eval()
    tok = AutoTokenizer.from_pretrained(tiny_embedder)
    for text, vec in zip(TEXTS, got, strict=True):
        with torch.inference_mode():
            states = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        want = {"mean": states.mean(dim=0), "cls": states[0], "last": states[-1]}[pooling]
        assert _max_diff(vec, want.tolist()) <= 1e-4


def test_embedding_pooling_option_is_checked(tiny_embedder: Path) -> None:
    with pytest.raises(ValueError, match="option pooling must be one of"):
        EmbeddingRunner(tiny_embedder, device="cpu", options={"pooling": "max"})


def test_classification_outputs(classifier: ClassificationRunner) -> None:
    out = classifier.run(classifier.encode(["what a day"]))[0]
    assert set(out["scores"]) == set(LABELS.values())
    assert out["label"] == max(out["scores"], key=out["scores"].get)
    assert abs(sum(out["scores"].values()) - 1.0) < 1e-4


def test_truncation_is_reported_per_input(embedder: EmbeddingRunner) -> None:
    rows = embedder.encode(["the dog " * 200, "the dog"])
    assert [r.truncated for r in rows] == [True, False]
    assert rows[0].tokens == embedder.max_tokens == 48


def test_padding_is_to_the_longest_row_not_max_tokens(embedder: EmbeddingRunner) -> None:
    rows = embedder.encode(["hi", "what a day"])
    batch = embedder.collate(rows)
    assert batch["input_ids"].shape == (2, max(r.tokens for r in rows))


def test_max_tokens_is_capped_by_the_model(tiny_embedder: Path) -> None:
    h = EmbeddingRunner(tiny_embedder, device=DEVICE, max_tokens=10_000)
    assert h.max_tokens == 128  # max_position_embeddings of the tiny model


def test_resolve_runners() -> None:
    assert resolve("embedding") is EmbeddingRunner
    assert resolve("text-classification") is ClassificationRunner
    assert resolve("batchfleet.worker.runners.embedding:EmbeddingRunner") is EmbeddingRunner
    with pytest.raises(ValueError, match="unknown runner"):
        resolve("nonsense")


def test_no_cuda_request_fails_clearly(tiny_embedder: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        EmbeddingRunner(tiny_embedder, device="cuda")


def test_collation_reuses_its_host_buffers(embedder: EmbeddingRunner) -> None:
    # Given a large batch collated first, then a smaller one
    big = embedder.collate(embedder.encode(TEXTS))
    ptr = big["input_ids"].data_ptr()
    small_rows = embedder.encode(["hi", "what a day"])
    allocations = embedder._buffers.allocations
    small = embedder.collate(small_rows)
    # Then the small batch is a view of the same memory (on CUDA, its device copy is
    # made from that pinned memory), padded and masked afresh
    assert embedder._buffers.allocations == allocations
    assert small["input_ids"].data_ptr() == ptr or small["input_ids"].is_cuda
    assert small["input_ids"].is_contiguous()
    width = max(r.tokens for r in small_rows)
    assert small["attention_mask"].sum(dim=1).tolist() == [r.tokens for r in small_rows]
    assert small["input_ids"][0, small_rows[0].tokens :].tolist() == [embedder.pad_id] * (
        width - small_rows[0].tokens
    )
    # and the outputs match a fresh run of each row alone (nothing left from the big batch)
    for row, out in zip(small_rows, embedder.run(small_rows), strict=True):
        assert _max_diff(out, embedder.run([row])[0]) <= 1e-4


def test_host_buffers_grow_when_a_batch_is_larger() -> None:
    from batchfleet.worker.host_buffers import HostBuffers

    buffers = HostBuffers(["input_ids"], initial=8)
    assert buffers.take(2, 4)["input_ids"].shape == (2, 4)
    assert buffers.take(3, 5)["input_ids"].shape == (3, 5)
    assert buffers.capacity >= 16


def test_prepare_many_reports_costs_and_truncation(embedder: EmbeddingRunner) -> None:
    from batchfleet.schemas.messages import Request

    reqs = [
        Request(id="a", model="m", inputs=["hi", "the dog " * 200]),
        Request(id="b", model="m", inputs=["what a day"]),
    ]
    a, b = embedder.prepare_many(reqs)
    assert not isinstance(a, Exception) and not isinstance(b, Exception)
    assert (a.rows, a.tokens, a.truncated) == (2, 48, (False, True))
    hi = len(embedder.encode(["hi"])[0].ids)
    assert a.input_tokens == hi + 48  # every row's tokens, the truncated one's as kept
    assert b.rows == 1 and b.tokens == len(embedder.encode(["what a day"])[0].ids)
    assert b.input_tokens == b.tokens


def test_a_runner_needing_weights_says_so_without_a_path() -> None:
    with pytest.raises(ValueError, match="needs `path`"):
        EmbeddingRunner(None, device="cpu")


def test_cudnn_attention_is_off_for_cuda_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from batchfleet.worker.device import CUDNN_ATTENTION_ENV, configure_cuda

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        # cuDNN plans attention per input shape: a worker's shapes change every step
        monkeypatch.delenv(CUDNN_ATTENTION_ENV, raising=False)
        assert configure_cuda() and not torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv(CUDNN_ATTENTION_ENV, "1")
        assert not configure_cuda() and torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
