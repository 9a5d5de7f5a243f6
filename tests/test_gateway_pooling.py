"""The gateway's pooling endpoints: each body → its submission, and the result → the answer.

Results are built as a worker builds them (the classification runner's ``label_scores``, the
rerank runner's ranking shape) and sent through the wire codec, as ``job.result()`` gets them.
"""

from __future__ import annotations

import base64
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from batchfleet.producer.gateway.endpoint import Answered, Endpoint, Submission
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.gateway.pooling import ENDPOINTS, encode_base64
from batchfleet.producer.submit import build_request, gather_inputs
from batchfleet.schemas.codec import decode_result, encode_result
from batchfleet.schemas.messages import Request, Result, Usage
from batchfleet.worker.runners.classification import label_scores

ANSWERED = Answered(id="x-r1", created=1_765_000_000)
EMBEDDINGS = ENDPOINTS["/v1/embeddings"]
SCORE = ENDPOINTS["/score"]
RERANK = ENDPOINTS["/rerank"]
CLASSIFY = ENDPOINTS["/classify"]
POOLING = ENDPOINTS["/pooling"]
USAGE = {"prompt_tokens": 7, "total_tokens": 7}
SEVEN = Usage(prompt_tokens=7)


def _result(outputs: list[Any], usage: Usage | None = SEVEN) -> Result:
    """An ``ok`` result as the producer decodes it from the wire (it took 7 tokens)."""
    res = Result(id="r1", model="m", status="ok", outputs=outputs, usage=usage)
    return decode_result(encode_result(res, "msgpack"))


def _request(sub: Submission) -> Request:
    """The request ``AsyncProducer.submit(sub.model, **sub.options)`` would send."""
    opts = dict(sub.options)
    inputs = gather_inputs(opts.pop("inputs", None), **opts)
    return build_request(sub.model, inputs)


def _refused(endpoint: Endpoint, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        endpoint.submission(body)
    assert info.value.status == 400
    assert info.value.code == "invalid_request"
    return info.value


def _classified(logits: list[list[float]]) -> list[dict[str, Any]]:
    config = SimpleNamespace(id2label={0: "neg", 1: "neu", 2: "pos"}, problem_type=None)
    return label_scores(torch.tensor(logits), config)


def test_paths() -> None:
    assert set(ENDPOINTS) == {
        "/v1/embeddings",
        "/pooling",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/classify",
    }
    assert ENDPOINTS["/v1/score"] is SCORE and ENDPOINTS["/v2/rerank"] is RERANK
    assert [e.id_prefix for e in (EMBEDDINGS, SCORE, RERANK, CLASSIFY, POOLING)] == [
        "embd",
        "score",
        "rerank",
        "classify",
        "pool",
    ]


# --- /v1/embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "texts"), [("hello", ["hello"]), (["a", "b c"], ["a", "b c"])])
def test_embeddings_submission(given: Any, texts: list[str]) -> None:
    body = {"model": "minilm", "input": given, "user": "u-1", "encoding_format": None}
    sub = EMBEDDINGS.submission(body)
    assert sub == Submission("minilm", {"inputs": texts})
    assert _request(sub).inputs == texts


def test_embeddings_answer_floats() -> None:
    body = {"model": "minilm", "input": ["a", "b"]}
    vectors = [[0.625, -0.75], [1.0, 0.0]]  # exact in float32, as the wire carries them
    assert EMBEDDINGS.answer(body, _result(vectors), ANSWERED) == {
        "id": "x-r1",
        "object": "list",
        "created": 1_765_000_000,
        "model": "minilm",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.625, -0.75]},
            {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]},
        ],
        "usage": USAGE,
    }


def test_embeddings_base64_round_trip() -> None:
    vectors = [[0.1, -0.25, 3.5e-8, 1.0], [-1.0, 0.0, 0.5, 0.3333]]
    body = {"model": "minilm", "input": ["a", "b"], "encoding_format": "base64"}
    answer = EMBEDDINGS.answer(body, _result(vectors), ANSWERED)
    for item, vector in zip(answer["data"], vectors, strict=True):
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == 4 * len(vector)
        # as OpenAI's client reads it (numpy, float32), and explicitly little-endian
        np.testing.assert_allclose(np.frombuffer(raw, dtype="<f4"), vector, rtol=1e-6)
        assert struct.unpack(f"<{len(vector)}f", raw) == tuple(
            np.asarray(vector, dtype=np.float32).tolist()
        )


def test_embeddings_answer_is_openais_shape() -> None:
    from openai.types import CreateEmbeddingResponse

    body = {"model": "minilm", "input": ["a", "b"]}
    answer = EMBEDDINGS.answer(body, _result([[0.5, 0.25], [1.0, 0.0]]), ANSWERED)
    parsed = CreateEmbeddingResponse.model_validate(answer)
    assert [e.embedding for e in parsed.data] == [[0.5, 0.25], [1.0, 0.0]]
    assert (parsed.usage.prompt_tokens, parsed.usage.total_tokens) == (7, 7)


def test_usage_of_a_worker_too_old_to_count_tokens_is_0() -> None:
    body = {"model": "minilm", "input": ["a"]}
    answer = EMBEDDINGS.answer(body, _result([[0.5, 0.25]], usage=None), ANSWERED)
    assert answer["usage"] == {"prompt_tokens": 0, "total_tokens": 0}


def test_encode_base64_is_little_endian_float32() -> None:
    assert base64.b64decode(encode_base64([1.0])) == b"\x00\x00\x80\x3f"


def test_embeddings_dimensions_only_the_models_own() -> None:
    body = {"model": "minilm", "input": "a", "dimensions": 3}
    assert EMBEDDINGS.answer(body, _result([[1.0, 0.0, 0.0]]), ANSWERED)["data"][0][
        "embedding"
    ] == [1.0, 0.0, 0.0]
    with pytest.raises(ApiError) as info:
        EMBEDDINGS.answer({**body, "dimensions": 2}, _result([[1.0, 0.0, 0.0]]), ANSWERED)
    assert (info.value.status, info.value.param) == (400, "dimensions")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a"}, "model"),
        ({"model": 3, "input": "a"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": 7}, "input"),
        ({"model": "m", "input": [1, 2, 3]}, "input"),
        ({"model": "m", "input": [[1, 2], [3]]}, "input"),
        ({"model": "m", "input": ["a", 3]}, "input"),
        ({"model": "m", "input": [{"type": "text", "text": "a"}]}, "input"),
        ({"model": "m", "input": "a", "encoding_format": "bytes"}, "encoding_format"),
        ({"model": "m", "input": "a", "dimensions": 0}, "dimensions"),
        ({"model": "m", "input": "a", "dimensions": True}, "dimensions"),
        ({"model": "m", "input": "a", "dimensions": "8"}, "dimensions"),
        ({"model": "m", "input": "a", "truncate_prompt_tokens": 16}, "truncate_prompt_tokens"),
        ({"model": "m", "input": "a", "priority": 2}, "priority"),
        ({"model": "m", "input": "a", "use_activation": False}, "use_activation"),
        ({"model": "m", "messages": [{"role": "user", "content": "a"}]}, "messages"),
        ({"model": "m", "input": "a", "task": "embed"}, "task"),
    ],
)
def test_embeddings_refuses(body: dict[str, Any], param: str) -> None:
    assert _refused(EMBEDDINGS, body).param == param


def test_token_ids_refused_with_a_reason() -> None:
    err = _refused(EMBEDDINGS, {"model": "m", "input": [101, 2023, 102]})
    assert "token ids" in err.message


def test_vllm_neutral_values_accepted() -> None:
    body = {
        "model": "m",
        "input": "a",
        "truncate_prompt_tokens": -1,
        "priority": 0,
        "use_activation": None,
    }
    assert EMBEDDINGS.submission(body) == Submission("m", {"inputs": ["a"]})


def test_embeddings_of_a_classifier_refused() -> None:
    with pytest.raises(ApiError) as info:
        EMBEDDINGS.answer({"model": "m", "input": "a"}, _result(_classified([[1, 2, 3]])), ANSWERED)
    assert (info.value.status, info.value.param) == (400, "model")
    assert "does not answer embeddings" in info.value.message


# --- /score ------------------------------------------------------------------------------------


def test_score_one_to_one() -> None:
    body = {"model": "rr", "text_1": "q", "text_2": "d"}
    sub = SCORE.submission(body)
    assert sub == Submission("rr", {"query": "q", "documents": ["d"]})
    assert _request(sub).model_dump()["inputs"] == [
        {"query": "q", "documents": ["d"], "top_n": None}
    ]
    answer = SCORE.answer(body, _result([[{"index": 0, "score": 2.5}]]), ANSWERED)
    assert answer == {
        "id": "x-r1",
        "object": "list",
        "created": 1_765_000_000,
        "model": "rr",
        "data": [{"index": 0, "object": "score", "score": 2.5}],
        "usage": USAGE,
    }


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("text_1", "text_2"),
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
    ],
)
def test_score_one_to_many_in_documents_order(first: str, second: str) -> None:
    body = {"model": "rr", first: ["q"], second: ["d0", "d1", "d2"]}
    assert SCORE.submission(body) == Submission(
        "rr", {"query": "q", "documents": ["d0", "d1", "d2"]}
    )
    # the rerank runner answers a ranking best first; score answers in the documents' order
    ranked = [{"index": 2, "score": 0.875}, {"index": 0, "score": 0.5}, {"index": 1, "score": -1.0}]
    data = SCORE.answer(body, _result([ranked]), ANSWERED)["data"]
    assert [(d["index"], d["score"]) for d in data] == [(0, 0.5), (1, -1.0), (2, 0.875)]


def test_score_many_to_many_as_pairs() -> None:
    body = {"model": "rr", "text_1": ["q0", "q1"], "text_2": ["d0", "d1"]}
    sub = SCORE.submission(body)
    assert sub == Submission("rr", {"pairs": [("q0", "d0"), ("q1", "d1")]})
    assert _request(sub).model_dump()["inputs"] == [
        {"text": "q0", "text_pair": "d0"},
        {"text": "q1", "text_pair": "d1"},
    ]
    data = SCORE.answer(body, _result([0.25, -3.0]), ANSWERED)["data"]
    assert data == [
        {"index": 0, "object": "score", "score": 0.25},
        {"index": 1, "object": "score", "score": -3.0},
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "rr", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ({"model": "rr", "text_1": ["a", "b"], "text_2": "c"}, "text_2"),
        ({"model": "rr", "text_1": "a"}, "text_1"),
        (
            {"model": "rr", "text_1": "a", "text_2": "b", "queries": "c", "documents": "d"},
            "text_1",
        ),
        ({"model": "rr", "queries": "a", "documents": "b", "items": "c"}, "text_1"),
        ({"model": "rr", "text_1": [], "text_2": "b"}, "text_1"),
        ({"model": "rr", "text_1": "a", "text_2": ["b", None]}, "text_2"),
        ({"model": "rr", "text_1": "a", "text_2": {"content": [{"type": "text"}]}}, "text_2"),
        ({"model": "rr", "text_1": "a", "text_2": "b", "use_activation": True}, "use_activation"),
        ({"text_1": "a", "text_2": "b"}, "model"),
    ],
)
def test_score_refuses(body: dict[str, Any], param: str) -> None:
    assert _refused(SCORE, body).param == param


def test_score_of_a_classifier_refused() -> None:
    body = {"model": "nli", "text_1": ["p0", "p1"], "text_2": ["h0", "h1"]}
    with pytest.raises(ApiError) as info:
        SCORE.answer(body, _result(_classified([[1, 2, 3], [3, 2, 1]])), ANSWERED)
    assert info.value.param == "model"


# --- /rerank -----------------------------------------------------------------------------------

DOCS = ["Paris is in France.", "A cat is a small mammal.", "Cats purr."]
RANKED = [{"index": 1, "score": 7.5}, {"index": 2, "score": 3.0}, {"index": 0, "score": -4.0}]


def test_rerank_submission() -> None:
    body = {"model": "rr", "query": "what is a cat", "documents": DOCS, "top_n": 2}
    sub = RERANK.submission(body)
    assert sub == Submission("rr", {"query": "what is a cat", "documents": DOCS, "top_n": 2})
    assert _request(sub).model_dump()["inputs"] == [
        {"query": "what is a cat", "documents": DOCS, "top_n": 2}
    ]


@pytest.mark.parametrize("top_n", [None, 0])
def test_rerank_top_n_zero_or_absent_is_all(top_n: int | None) -> None:
    sub = RERANK.submission({"model": "rr", "query": "q", "documents": "d", "top_n": top_n})
    assert sub == Submission("rr", {"query": "q", "documents": ["d"], "top_n": None})


def test_rerank_answer_best_first_with_documents() -> None:
    body = {"model": "rr", "query": "what is a cat", "documents": DOCS, "top_n": 2}
    answer = RERANK.answer(body, _result([RANKED[:2]]), ANSWERED)
    assert answer == {
        "id": "x-r1",
        "model": "rr",
        "usage": USAGE,
        "results": [
            {"index": 1, "relevance_score": 7.5, "document": {"text": DOCS[1]}},
            {"index": 2, "relevance_score": 3.0, "document": {"text": DOCS[2]}},
        ],
    }


def test_rerank_return_documents_false() -> None:
    body = {"model": "rr", "query": "q", "documents": DOCS, "return_documents": False}
    results = RERANK.answer(body, _result([RANKED]), ANSWERED)["results"]
    assert results == [
        {"index": i, "relevance_score": s} for i, s in ((1, 7.5), (2, 3.0), (0, -4.0))
    ]


def test_rerank_index_out_of_range_refused() -> None:
    body = {"model": "rr", "query": "q", "documents": ["d"]}
    with pytest.raises(ApiError):
        RERANK.answer(body, _result([[{"index": 3, "score": 1.0}]]), ANSWERED)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "rr", "documents": DOCS}, "query"),
        ({"model": "rr", "query": ["q"], "documents": DOCS}, "query"),
        ({"model": "rr", "query": "q"}, "documents"),
        ({"model": "rr", "query": "q", "documents": []}, "documents"),
        ({"model": "rr", "query": "q", "documents": [{"text": "d"}]}, "documents"),
        ({"model": "rr", "query": "q", "documents": DOCS, "top_n": -1}, "top_n"),
        ({"model": "rr", "query": "q", "documents": DOCS, "top_n": "2"}, "top_n"),
        ({"model": "rr", "query": "q", "documents": DOCS, "top_n": 1.5}, "top_n"),
        (
            {"model": "rr", "query": "q", "documents": DOCS, "return_documents": "no"},
            "return_documents",
        ),
        ({"model": "rr", "query": "q", "documents": DOCS, "rank_fields": ["t"]}, "rank_fields"),
        (
            {"model": "rr", "query": "q", "documents": DOCS, "max_tokens_per_doc": 8},
            "max_tokens_per_doc",
        ),
    ],
)
def test_rerank_refuses(body: dict[str, Any], param: str) -> None:
    assert _refused(RERANK, body).param == param


# --- /classify ---------------------------------------------------------------------------------


def test_classify() -> None:
    body = {"model": "sst", "input": ["good", "bad"]}
    assert CLASSIFY.submission(body) == Submission("sst", {"inputs": ["good", "bad"]})
    outputs = _classified([[0.0, 1.0, 4.0], [3.0, 0.0, -1.0]])
    answer = CLASSIFY.answer(body, _result(outputs), ANSWERED)
    assert answer["id"] == "x-r1" and answer["object"] == "list" and answer["model"] == "sst"
    assert answer["created"] == 1_765_000_000 and answer["usage"] == USAGE
    labels = [(d["index"], d["label"], d["num_classes"]) for d in answer["data"]]
    assert labels == [(0, "pos", 3), (1, "neg", 3)]
    for item, out in zip(answer["data"], outputs, strict=True):
        assert item["probs"] == list(out["scores"].values())  # in label-id order
        assert abs(sum(item["probs"]) - 1.0) < 1e-6
        assert item["probs"].index(max(item["probs"])) == ["neg", "neu", "pos"].index(item["label"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "sst"}, "input"),
        ({"model": "sst", "input": [[1, 2]]}, "input"),
        ({"model": "sst", "input": "a", "encoding_format": "float"}, "encoding_format"),
    ],
)
def test_classify_refuses(body: dict[str, Any], param: str) -> None:
    assert _refused(CLASSIFY, body).param == param


def test_classify_of_an_embedder_refused() -> None:
    with pytest.raises(ApiError) as info:
        CLASSIFY.answer({"model": "m", "input": "a"}, _result([[0.6, 0.8]]), ANSWERED)
    assert info.value.param == "model" and "lists" in info.value.message


# --- /pooling ----------------------------------------------------------------------------------


def test_pooling_embeddings_and_probabilities() -> None:
    body = {"model": "m", "input": "a"}
    assert POOLING.submission({**body, "task": "embed"}) == Submission("m", {"inputs": ["a"]})
    vector = POOLING.answer(body, _result([[0.625, 0.75]]), ANSWERED)
    assert vector["data"] == [{"index": 0, "object": "pooling", "data": [0.625, 0.75]}]
    outputs = _classified([[1.0, 2.0, 3.0]])
    probs = POOLING.answer(body, _result(outputs), ANSWERED)["data"][0]["data"]
    assert probs == list(outputs[0]["scores"].values())
    packed = POOLING.answer({**body, "encoding_format": "base64"}, _result([[0.5]]), ANSWERED)
    assert packed["data"][0]["data"] == encode_base64([0.5])


def test_pooling_task_must_match_the_model() -> None:
    with pytest.raises(ApiError) as info:
        POOLING.answer({"model": "m", "input": "a", "task": "classify"}, _result([[0.6]]), ANSWERED)
    assert info.value.param == "model"
    assert _refused(POOLING, {"model": "m", "input": "a", "task": "token_embed"}).param == "task"
