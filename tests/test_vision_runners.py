"""Image, image-text and pair runners on tiny random-weight models loaded from disk like real
ones, fed real PNG/JPEG/WebP files of many sizes and aspect ratios."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.inputs import InputLimits
from batchfleet.schemas.messages import Request
from batchfleet.worker.blobs import with_fetched
from batchfleet.worker.runner import Final, Prepared, PrepareError, Work
from batchfleet.worker.runners import resolve
from batchfleet.worker.runners.classification import ClassificationRunner
from batchfleet.worker.runners.image_classification import ImageClassificationRunner
from batchfleet.worker.runners.image_text import ImageTextEmbeddingRunner
from batchfleet.worker.runners.rerank import RerankRunner
from devices import DEVICE
from PIL import Image
from tiny_vision import IMAGE_LABELS, SIZES, decompression_bomb, image_file, image_files
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

TEXTS = ["a cat", "the dog is on the back of a man", "x", "what a day it is"]


def _max_diff(a: object, b: object) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


def _scores(out: dict[str, Any]) -> list[float]:
    return list(out["scores"].values())


def _built(cls: type, model: str, **kw: Any) -> Any:
    """A module fixture: ``cls`` on the tiny model of session fixture ``model``, on the CPU."""

    @pytest.fixture(scope="module")
    def fixture(request: pytest.FixtureRequest) -> Any:
        return cls(request.getfixturevalue(model), device=DEVICE, dtype="float32", **kw)

    return fixture


vit = _built(ImageClassificationRunner, "tiny_vit")
siglip2 = _built(
    ImageClassificationRunner, "tiny_siglip2", options={"keep_native_resolution": True}
)
clip = _built(ImageTextEmbeddingRunner, "tiny_clip", max_tokens=64)
reranker = _built(RerankRunner, "tiny_reranker", max_tokens=64)


def _request(*inputs: Any, rid: str = "r") -> Request:
    return Request.model_validate({"id": rid, "model": "m", "inputs": list(inputs)})


def _prepare(runner: Any, *inputs: Any) -> Prepared | PrepareError:
    (prep,) = runner.prepare_many([with_fetched(_request(*inputs), {})])
    assert isinstance(prep, Prepared | PrepareError)
    return prep


# --- batch invariance -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["vit", "siglip2"])
def test_image_classification_batch_invariance_with_mixed_sizes(
    which: str, request: pytest.FixtureRequest
) -> None:
    runner: ImageClassificationRunner = request.getfixturevalue(which)
    rows = runner.encode(image_files(len(SIZES)))
    together = runner.run(rows)
    for row, out in zip(rows, together, strict=True):
        alone = runner.run([row])[0]
        assert out["label"] == alone["label"] and out["label"] in IMAGE_LABELS.values()
        assert _max_diff(_scores(out), _scores(alone)) <= 1e-4


def test_native_resolution_rows_cost_their_patches(siglip2: ImageClassificationRunner) -> None:
    # Given images of many sizes through a native-resolution (NaFlex) processor
    rows = siglip2.encode(image_files(len(SIZES)))
    # Then each row's cost feature is its own patch count, padded to the longest per batch
    assert len({r.tokens for r in rows}) >= 4
    assert all(r.grid is not None and r.grid[0] * r.grid[1] == r.tokens for r in rows)
    assert max(r.tokens for r in rows) <= siglip2.images.max_patches
    batch = siglip2.images.collate(rows)
    assert batch["pixel_values"].shape[1] == max(r.tokens for r in rows)
    assert batch["pixel_attention_mask"].sum(dim=1).tolist() == [r.tokens for r in rows]


def test_fixed_size_rows_all_cost_the_same(vit: ImageClassificationRunner) -> None:
    rows = vit.encode(image_files(6))
    assert {r.tokens for r in rows} == {(32 // 8) ** 2 + 1}
    assert vit.images.collate(rows)["pixel_values"].shape == (6, 3, 32, 32)


def test_clip_batch_invariance_texts_and_images_mixed(clip: ImageTextEmbeddingRunner) -> None:
    inputs: list[Any] = [*image_files(5), *TEXTS]
    inputs = inputs[::2] + inputs[1::2]  # interleave kinds
    rows = clip.encode(inputs)
    together = clip.run(rows)
    for row, out in zip(rows, together, strict=True):
        assert _max_diff(out, clip.run([row])[0]) <= 1e-4
        assert abs(sum(x * x for x in out) - 1.0) < 1e-4


def test_rerank_batch_invariance(reranker: RerankRunner) -> None:
    pairs = [{"text": q, "text_pair": d} for q in TEXTS[:2] for d in TEXTS]
    preps = reranker.prepare_many([_request(p, rid=f"r{i}") for i, p in enumerate(pairs)])
    rows = [row for p in preps if isinstance(p, Prepared) for row in p.payload]
    assert len({r.tokens for r in rows}) > 2, "needs mixed lengths to exercise padding"
    together = reranker.run(rows)
    for row, out in zip(rows, together, strict=True):
        assert abs(out - reranker.run([row])[0]) <= 1e-4


# --- CLIP matches the model's own features ----------------------------------------------------


def test_clip_matches_get_image_features_and_get_text_features(
    clip: ImageTextEmbeddingRunner, tiny_clip: Path
) -> None:
    model = CLIPModel.from_pretrained(tiny_clip).eval()
    processor = AutoImageProcessor.from_pretrained(tiny_clip)
    tokenizer = AutoTokenizer.from_pretrained(tiny_clip)
    images = image_files(4, seed=9)
    ours = clip.run(clip.encode([*images, *TEXTS]))
    with torch.no_grad():
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
        img = model.get_image_features(pixel_values=pixels).pooler_output
        enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
        txt = model.get_text_features(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
        ).pooler_output
    want = torch.nn.functional.normalize(torch.cat([img, txt]), dim=-1)
    assert _max_diff(ours, want) <= 1e-4


def test_siglip_pads_texts_to_its_max_length_and_matches_its_features(tiny_siglip: Path) -> None:
    from transformers import SiglipModel

    runner = ImageTextEmbeddingRunner(tiny_siglip, device=DEVICE, dtype="float32", max_tokens=64)
    assert runner.pad_width == runner.max_tokens == 16
    rows = runner.encode([*TEXTS, *image_files(3, seed=5)])
    ours = runner.run(rows)
    for row, out in zip(rows, ours, strict=True):  # batch invariance: fixed-length texts
        assert _max_diff(out, runner.run([row])[0]) <= 1e-4
    model = SiglipModel.from_pretrained(tiny_siglip).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_siglip)
    processor = AutoImageProcessor.from_pretrained(tiny_siglip)
    with torch.no_grad():
        enc = tokenizer(TEXTS, padding="max_length", max_length=16, return_tensors="pt")
        txt = model.get_text_features(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
        ).pooler_output
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in image_files(3, seed=5)]
        pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
        img = model.get_image_features(pixel_values=pixels).pooler_output
    want = torch.nn.functional.normalize(torch.cat([txt, img]), dim=-1)
    assert _max_diff(ours, want) <= 1e-4


# --- rerank: pairs and rankings ----------------------------------------------------------------


def test_ranking_is_sorted_and_agrees_with_pairs(reranker: RerankRunner) -> None:
    query, docs = "the dog", ["a cat", "the dog is on the back of a man", "x", "what a day"]
    ranking = {"query": query, "documents": docs, "top_n": 3}
    pairs = [{"text": query, "text_pair": d} for d in docs]
    prep = _prepare(reranker, ranking, *pairs)
    assert isinstance(prep, Prepared) and prep.rows == 2 * len(docs)
    assert prep.truncated == (False,) * 5
    (event,) = reranker.step(Work("s", (("k", prep),))).events
    assert isinstance(event, Final)
    ranked, *scores = event.outputs
    assert (
        len(ranked) == 3
        and [r["index"] for r in ranked] == sorted(range(len(docs)), key=lambda i: -scores[i])[:3]
    )
    for r in ranked:
        assert abs(r["score"] - scores[r["index"]]) <= 1e-5


def test_text_classification_takes_pairs(tiny_classifier: Path) -> None:
    runner = ClassificationRunner(tiny_classifier, device=DEVICE, dtype="float32", max_tokens=64)
    prep = _prepare(runner, {"text": "a man sleeps", "text_pair": "a man is awake"}, "hi")
    assert isinstance(prep, Prepared) and prep.rows == 2
    (event,) = runner.step(Work("s", (("k", prep),))).events
    assert isinstance(event, Final) and len(event.outputs) == 2
    assert abs(sum(event.outputs[0]["scores"].values()) - 1.0) < 1e-4


def test_builtin_names_resolve() -> None:
    assert resolve("image-classification") is ImageClassificationRunner
    assert resolve("image-text-embedding") is ImageTextEmbeddingRunner
    assert resolve("rerank") is RerankRunner


# --- bad inputs: stable codes, request by request ---------------------------------------------


def _truncated() -> bytes:
    whole = image_file(64, 48, "PNG")
    return whole[: len(whole) // 2]


BAD_IMAGES = {
    "truncated png": _truncated(),
    "truncated jpeg": image_file(64, 48, "JPEG")[:300],
    "decompression bomb (over Pillow's guard)": decompression_bomb(20_000),
    "decompression bomb (over max_image_pixels)": decompression_bomb(5_000),
    "gif (a format not allowed)": image_file(16, 16, "GIF"),
    "bmp (a format not allowed)": image_file(16, 16, "BMP"),
    "not an image": b"%PDF-1.7 this is not an image",
    "missing image key": {"image_key": "bf:{m}:input:gone"},
}


@pytest.mark.parametrize("name", BAD_IMAGES)
def test_bad_images_are_invalid_input(vit: ImageClassificationRunner, name: str) -> None:
    prep = _prepare(vit, BAD_IMAGES[name])
    assert isinstance(prep, PrepareError) and prep.code is ErrorCode.INVALID_INPUT, prep
    assert "inputs[0]" in str(prep)


def test_bad_image_fails_only_its_request(vit: ImageClassificationRunner) -> None:
    good = image_files(3)
    reqs = [_request(good[0], rid="a"), _request(good[1], _truncated(), rid="b"),
            _request(good[2], rid="c")]  # fmt: skip
    a, b, c = vit.prepare_many(reqs)
    assert isinstance(a, Prepared) and isinstance(c, Prepared)
    assert isinstance(b, PrepareError) and "inputs[1]" in str(b)


def test_wrong_kinds_are_invalid_input(
    vit: ImageClassificationRunner, clip: ImageTextEmbeddingRunner, reranker: RerankRunner,
    tiny_embedder: Path,
) -> None:  # fmt: skip
    from batchfleet.worker.runners.embedding import EmbeddingRunner

    text_model = EmbeddingRunner(tiny_embedder, device=DEVICE, max_tokens=32)
    cases = [
        (vit, "a text where an image is due"),
        (text_model, image_file(8, 8)),  # bytes where a text is due
        (reranker, "a text where a pair is due"),
        (clip, {"text": "a", "text_pair": "b"}),
    ]
    for runner, item in cases:
        prep = _prepare(runner, item)
        assert isinstance(prep, PrepareError) and prep.code is ErrorCode.INVALID_INPUT, prep


def test_model_limits_apply(tiny_vit: Path) -> None:
    runner = ImageClassificationRunner(tiny_vit, device=DEVICE, dtype="float32")
    runner.input_limits = InputLimits(max_image_pixels=50 * 50, image_formats=("PNG",))
    assert isinstance(_prepare(runner, image_file(50, 50, "PNG")), Prepared)
    for item in (image_file(51, 50, "PNG"), image_file(20, 20, "JPEG")):
        prep = _prepare(runner, item)
        assert isinstance(prep, PrepareError) and prep.code is ErrorCode.INVALID_INPUT


def test_image_modes_and_exif_orientation(vit: ImageClassificationRunner) -> None:
    for mode, fmt in (("L", "PNG"), ("RGBA", "PNG"), ("P", "PNG"), ("RGBA", "WEBP")):
        assert isinstance(_prepare(vit, image_file(20, 30, fmt, mode=mode)), Prepared)


# --- reused host buffers ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["vit", "siglip2", "clip"])
def test_steady_state_allocates_no_batch_buffers(
    which: str, request: pytest.FixtureRequest
) -> None:
    runner = request.getfixturevalue(which)
    images = image_files(8, seed=3)
    inputs: list[Any] = images + (TEXTS if which == "clip" else [])
    runner.run(runner.encode(inputs))  # warm up: the largest batch
    before = runner.info()["host_buffer_allocations"]
    for size in (1, 3, 8, 2, 5, 8):
        runner.run(runner.encode(inputs[:size]))
    assert runner.info()["host_buffer_allocations"] == before
