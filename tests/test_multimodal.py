"""Images, image-text embeddings and rerankers end to end: both producers, a real worker loop
(burst mode) on a real server; bad images answered ``invalid_input`` one by one; images
passed by reference; the wire (msgpack ``bin``, JSON ``image_b64``) and its limits."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from batchfleet.producer import AsyncProducer, Producer
from batchfleet.producer.submit import gather_inputs
from batchfleet.schemas.codec import EntryRejected, decode_entry, encode_request
from batchfleet.schemas.errors import ErrorCode, RequestRejected
from batchfleet.schemas.inputs import (
    ImageB64,
    ImageRef,
    InputLimits,
    Ranking,
    TextPair,
    TokenPrompt,
)
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Limits, Request, Result
from batchfleet.worker.arrivals import BLOB_READ_TRIES
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runners.image_classification import ImageClassificationRunner
from batchfleet.worker.runners.image_text import ImageTextEmbeddingRunner
from batchfleet.worker.runners.rerank import RerankRunner
from batchfleet.worker.streams import ModelStreams
from devices import DEVICE
from tiny_vision import IMAGE_LABELS, decompression_bomb, image_file, image_files

from batchfleet.config import ModelConfig, WorkerConfig

pytestmark = pytest.mark.timeout(120)


def _serve(r: redis.Redis, model: str, runner: Any, **config: Any) -> BatchLoop:
    """Run one burst of a worker loop over what is queued for ``model``."""
    cfg = ModelConfig(path="/unused", **config)
    loop = BatchLoop(model, cfg, runner, r, consumer="w1", worker=WorkerConfig(block_ms=20),
                     burst=True)  # fmt: skip
    loop.run()
    return loop


def _result(r: redis.Redis, model: str, rid: str) -> Result:
    from batchfleet.schemas.codec import decode_result

    raw = r.get(ModelKeys(model).result(rid))
    assert raw is not None, f"no result for {rid}"
    return decode_result(raw)


# --- the wire -----------------------------------------------------------------------------------


def _fields(body: dict[str, Any], fmt: str = "msgpack") -> dict[bytes, bytes]:
    raw = msgpack.packb(body, use_bin_type=True) if fmt == "msgpack" else json.dumps(body).encode()
    return {fmt.encode(): raw}


GOOD = {"id": "r1", "model": "m"}
PNG = image_file(16, 12)


@pytest.mark.parametrize(
    ("inputs", "fmt", "kind"),
    [
        ([PNG], "msgpack", bytes),
        ([{"image_b64": base64.b64encode(PNG).decode()}], "json", ImageB64),
        ([{"image_b64": base64.b64encode(PNG).decode()}], "msgpack", ImageB64),
        ([{"image_key": "bf:{m}:input:cat-1"}], "json", ImageRef),
        ([{"text": "q", "text_pair": "d"}], "json", TextPair),
        ([{"query": "q", "documents": ["a", "b"], "top_n": 1}], "msgpack", Ranking),
        (["plain text"], "json", str),
        ([{"prompt_token_ids": [1, 2, 3]}], "msgpack", TokenPrompt),
        ([{"prompt_token_ids": [0]}], "json", TokenPrompt),
    ],
)
def test_input_kinds_decode(inputs: list[Any], fmt: str, kind: type) -> None:
    request, _ = decode_entry(_fields({**GOOD, "inputs": inputs}, fmt), "m")
    assert isinstance(request.inputs[0], kind)


@pytest.mark.parametrize(
    ("inputs", "code"),
    [
        ([{"image_b64": "not base64!"}], ErrorCode.INVALID_REQUEST),
        ([{"image_key": "bf:{other}:input:x"}], ErrorCode.INVALID_REQUEST),  # another model's
        ([{"image_key": "bf:{m}:result:x"}], ErrorCode.INVALID_REQUEST),  # not an input key
        ([{"text": "q"}], ErrorCode.INVALID_REQUEST),
        ([{"text": "q", "text_pair": PNG}], ErrorCode.INVALID_REQUEST),  # bytes for a text
        ([{"text": " ", "text_pair": "d"}], ErrorCode.EMPTY_INPUT),
        ([{"query": "q", "documents": []}], ErrorCode.INVALID_REQUEST),
        ([{"query": "q", "documents": ["d"] * 300}], ErrorCode.TOO_LARGE),
        ([{"image": "what"}], ErrorCode.INVALID_REQUEST),
        ([b""], ErrorCode.EMPTY_INPUT),
        ([7], ErrorCode.INVALID_REQUEST),
        ([{"prompt_token_ids": []}], ErrorCode.EMPTY_INPUT),
        ([{"prompt_token_ids": ["1"]}], ErrorCode.INVALID_REQUEST),
        ([{"prompt_token_ids": [1], "text": "x"}], ErrorCode.INVALID_REQUEST),
        ([{"prompt_token_ids": [1] * 30_000}], ErrorCode.TOO_LARGE),
    ],
)
def test_bad_inputs_are_refused_with_stable_codes(inputs: list[Any], code: ErrorCode) -> None:
    with pytest.raises(EntryRejected) as info:
        decode_entry(_fields({**GOOD, "inputs": inputs}), "m")
    assert info.value.code is code, info.value


def test_image_bytes_over_the_limit_are_too_large() -> None:
    limits = Limits(inputs=InputLimits(max_image_bytes=1024))
    for inputs in ([b"x" * 2000], [{"image_b64": base64.b64encode(b"x" * 2000).decode()}]):
        with pytest.raises(EntryRejected) as info:
            decode_entry(_fields({**GOOD, "inputs": inputs}), "m", limits)
        assert info.value.code is ErrorCode.TOO_LARGE


def test_encoding_keeps_bytes_as_bin_and_base64_in_json() -> None:
    request = Request.model_validate({**GOOD, "inputs": [PNG, "text"]})
    packed = msgpack.unpackb(encode_request(request, "msgpack")[b"msgpack"])
    assert packed["inputs"] == [PNG, "text"]
    body = json.loads(encode_request(request, "json")[b"json"])
    assert base64.b64decode(body["inputs"][0]["image_b64"]) == PNG


def test_producer_refuses_bad_inputs_before_redis(r: redis.Redis) -> None:
    producer = Producer(client=r)
    with pytest.raises(RequestRejected) as info:
        producer.submit("m", query="q")  # documents missing
    assert info.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(RequestRejected) as info:
        producer.submit("m", images=[b"x" * (9 * 1_048_576)])
    assert info.value.code is ErrorCode.TOO_LARGE
    assert r.dbsize() == 0


def test_long_arrays_a_request_may_hold_decode_in_msgpack() -> None:
    # a prompt of 20,000 token ids (max_text_chars) and 8,192 allowed_token_ids, each
    # over msgpack's default array bound of 4,096 here
    body = {**GOOD, "inputs": [{"prompt_token_ids": [7] * 20_000}],
            "allowed_token_ids": list(range(8_192))}  # fmt: skip
    request, _ = decode_entry(_fields(body), "m")
    assert len(request.inputs[0].prompt_token_ids) == 20_000  # type: ignore[union-attr]
    assert request.allowed_token_ids is not None and len(request.allowed_token_ids) == 8_192


def test_one_input_map_is_one_input() -> None:
    # a map given as inputs is one input, not a list of its keys
    one = {"prompt_token_ids": [5, 6]}
    assert gather_inputs(one) == gather_inputs([one]) == [one]
    pair = TextPair(text="q", text_pair="d")
    assert gather_inputs(pair) == [{"text": "q", "text_pair": "d"}]


# --- through a worker loop ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def vit(tiny_vit: Path) -> ImageClassificationRunner:
    return ImageClassificationRunner(tiny_vit, device=DEVICE, dtype="float32")


def test_images_and_bad_images_through_a_worker(
    r: redis.Redis, redis_url: str, vit: ImageClassificationRunner
) -> None:
    # Given good images of many sizes and formats, and bad ones, in both encodings
    good = image_files(6)
    bad = {
        "truncated": image_file(64, 48)[:200],
        "bomb": decompression_bomb(5_000),
        "gif": image_file(16, 16, "GIF"),
        "text": "a text where an image is due",
    }
    producer = Producer(redis_url)
    json_producer = Producer(redis_url, wire_format="json")
    jobs = [producer.submit("vit", images=[img]) for img in good[:3]]
    jobs += [json_producer.submit("vit", images=[img]) for img in good[3:]]
    bad_jobs = {name: producer.submit("vit", inputs=[item]) for name, item in bad.items()}
    mixed = producer.submit("vit", inputs=[good[0], bad["truncated"]])

    # When one worker loop serves them (in batches that mix good and bad)
    loop = _serve(r, "vit", vit, batch={"max_batch_size": 8})

    # Then every good image is classified, each bad request alone is invalid_input
    for job in jobs:
        (out,) = job.outputs(timeout=5)
        assert out["label"] in IMAGE_LABELS.values()
    for name, job in bad_jobs.items():
        result = job.result(timeout=5)
        assert result.status == "error" and result.error is not None, name
        assert result.error.code is ErrorCode.INVALID_INPUT, (name, result.error)
    error = mixed.result(timeout=5).error
    assert error is not None and "inputs[1]" in error.message
    assert loop.stats.snapshot()["requests"]["ok"] == len(good)


def test_images_by_reference(
    r: redis.Redis, redis_url: str, vit: ImageClassificationRunner
) -> None:
    keys = ModelKeys("vit")
    img = image_file(300, 200, "JPEG")
    r.set(keys.input("cat-1"), img, ex=300)
    r.set(keys.input("huge"), b"\x89PNG" + b"\0" * 70_000, ex=300)
    producer = Producer(redis_url)
    ok = producer.submit("vit", inputs=[{"image_key": keys.input("cat-1")}])
    inline = producer.submit("vit", images=[img])
    missing = producer.submit("vit", inputs=[{"image_key": keys.input("gone")}])
    too_big = producer.submit("vit", inputs=[{"image_key": keys.input("huge")}])

    _serve(r, "vit", vit, limits={"inputs": {"max_image_bytes": 65_536}})

    assert ok.outputs(timeout=5) == inline.result(timeout=5).outputs
    assert r.get(keys.input("cat-1")) == img, "the worker reads, never deletes"
    for job, words in ((missing, "does not exist"), (too_big, "max_image_bytes")):
        error = job.result(timeout=5).error
        assert (
            error is not None and error.code is ErrorCode.INVALID_INPUT and words in error.message
        )


@pytest.mark.parametrize("failures", [1, BLOB_READ_TRIES])
def test_a_failed_read_of_a_referenced_image_is_retried_not_answered_missing(
    r: redis.Redis,
    redis_url: str,
    vit: ImageClassificationRunner,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failures: int,
) -> None:
    # Given a referenced image whose first reads fail (a connection reset): once, which the
    # intake retries, or as often as it tries, so it hands the request back to the fleet
    keys = ModelKeys("vit")
    img = image_file(64, 48, "PNG")
    r.set(keys.input("cat-2"), img, ex=300)
    read_inputs = ModelStreams.read_inputs
    left = [failures]

    def flaky(self: ModelStreams, names: list[str], max_bytes: int) -> list[bytes | None]:
        if left[0]:
            left[0] -= 1
            raise redis.ConnectionError("Connection reset by peer (injected)")
        return read_inputs(self, names, max_bytes)

    monkeypatch.setattr(ModelStreams, "read_inputs", flaky)
    producer = Producer(redis_url)
    job = producer.submit("vit", inputs=[{"image_key": keys.input("cat-2")}])
    inline = producer.submit("vit", images=[img])

    # When a worker serves them (bursts, until both are answered)
    with caplog.at_level(logging.WARNING, logger="batchfleet.worker.intake"):
        for _ in range(5):
            loop = _serve(r, "vit", vit)
            if r.exists(keys.result(job.id)):
                break

    # Then the image is read on a later try and classified: never answered as missing
    assert left == [0]
    assert job.outputs(timeout=5) == inline.result(timeout=5).outputs
    handed_back = "handed back" in caplog.text
    assert handed_back is (failures == BLOB_READ_TRIES)
    assert loop.stats.snapshot()["requests"].get("error", 0) == 0


def test_clip_and_reranker_with_both_producers(
    r: redis.Redis, redis_url: str, tiny_clip: Path, tiny_reranker: Path
) -> None:
    clip = ImageTextEmbeddingRunner(tiny_clip, device=DEVICE, dtype="float32", max_tokens=64)
    reranker = RerankRunner(tiny_reranker, device=DEVICE, dtype="float32", max_tokens=64)
    img = image_file(40, 30, "WEBP")
    docs = ["a cat", "the dog is on the back of a man", "x", "what a day"]

    async def submit_async() -> list[Any]:
        async with AsyncProducer(redis_url) as producer:
            return [
                await producer.submit("clip", images=[img]),
                await producer.submit("clip", inputs=["a cat"]),
                await producer.submit("reranker", pairs=[("the dog", d) for d in docs]),
                await producer.submit("reranker", query="the dog", documents=docs, top_n=2),
            ]

    with Producer(redis_url) as producer:
        sync = [
            producer.submit("clip", images=[img]),
            producer.submit("clip", inputs=["a cat"]),
            producer.submit("reranker", pairs=[("the dog", d) for d in docs]),
            producer.submit("reranker", query="the dog", documents=docs, top_n=2),
        ]
    aio = asyncio.run(submit_async())
    _serve(r, "clip", clip)
    _serve(r, "reranker", reranker)

    with Producer(redis_url) as producer:
        for jobs in (sync, aio):
            got = [producer.wait(job, timeout=5) for job in jobs]  # type: ignore[arg-type]
            assert all(g.ok for g in got), [g.error for g in got]
            image_vec, text_vec = got[0].outputs[0], got[1].outputs[0]  # type: ignore[index]
            assert len(image_vec) == len(text_vec) == 16  # one space
            scores, (ranked,) = got[2].outputs, got[3].outputs  # type: ignore[misc]
            assert len(scores) == len(docs) and len(ranked) == 2
            best = sorted(range(len(docs)), key=lambda i: -scores[i])[:2]
            assert [x["index"] for x in ranked] == best
