"""The pooling endpoints: OpenAI's ``/v1/embeddings`` and vLLM's score, rerank and classify
(and ``/pooling``), as translations to and from batchfleet's encoder requests.

Which runner answers which: ``embedding`` and ``image-text-embedding`` models embeddings;
``rerank`` models score and rerank (pairs and rankings); ``text-classification`` models
classify. A model whose outputs are of another shape is answered 400 (``param`` "model").

What is not mapped, and why:

- token-id inputs: no encoder runner takes them (``TokenPrompt`` is for generation);
- chat ``messages`` and multimodal score/rerank content: encoder runners take plain texts;
- ``dimensions`` other than the model's own size: the fleet cannot tell a Matryoshka model
  from another, so shortening a vector would not be truthful;
- ``use_activation``, ``truncate_prompt_tokens`` (but -1), ``priority`` (but 0) and the like:
  activation, truncation (always, to the model's ``max_tokens``) and lanes are the fleet's;
- score with an embedding model (vLLM's cosine similarity): a request names no runner, so
  the gateway cannot choose between pairs and texts;

``usage`` counts every token the model took (a score or rerank pair's query with each
text): the result's ``usage.prompt_tokens``, 0 from a worker too old to count them.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ...schemas.messages import Result
from .endpoint import Answered, Endpoint, Submission
from .errors import invalid

Body = Mapping[str, Any]

NEUTRAL: Final[dict[str, tuple[int, str]]] = {
    "truncate_prompt_tokens": (-1, "inputs are cut to the model's max_tokens"),
    "max_tokens_per_query": (0, "inputs are cut to the model's max_tokens"),
    "max_tokens_per_doc": (0, "inputs are cut to the model's max_tokens"),
    "priority": (0, "batchfleet's lanes are not vLLM's priorities"),
}
"""vLLM fields taken only at the value that asks for what the fleet does anyway, and why."""
COMMON: Final = frozenset({"model", "user", *NEUTRAL})
"""Fields every pooling endpoint takes (``user`` is ignored)."""
SCORE_NAMES: Final = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)
"""vLLM's names for the two sides of a score request."""
KINDS: Final[dict[type, str]] = {list: "lists", dict: "maps", float: "numbers", int: "numbers"}
"""How a mismatched output is named in the error."""


def _given(body: Body, name: str) -> Any:
    """A field's value; null is the same as absent."""
    return body.get(name)


def _check_fields(body: Body, takes: frozenset[str]) -> str:
    """Refuse fields this endpoint does not honour; return the model's name."""
    for name, value in body.items():
        neutral = name not in NEUTRAL or (_is_int(value) and value == NEUTRAL[name][0])
        if value is None or (name in takes and neutral):
            continue
        if name in NEUTRAL:
            only, why = NEUTRAL[name]
            raise invalid(f"{name} may only be {only}: {why}", name)
        fields = ", ".join(sorted(takes - {"user", *NEUTRAL}))
        raise invalid(f"unsupported field {name!r}: this endpoint takes {fields}", name)
    model = _given(body, "model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required: the name of a model the fleet serves", "model")
    return model


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _texts(value: Any, param: str) -> list[str]:
    """A string or a non-empty list of strings, as a list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid(f"{param} is a string or a non-empty list of strings", param)
    if all(_is_int(t) for t in value) or all(
        isinstance(t, list) and t and all(_is_int(i) for i in t) for t in value
    ):
        raise invalid(f"{param} as token ids is not supported: encoder models take texts", param)
    for i, text in enumerate(value):
        if not isinstance(text, str):
            what = "multimodal content is" if isinstance(text, dict) else "other items are"
            raise invalid(f"{param}[{i}] is not a string ({what} not supported)", param)
    return list(value)


def _outputs(
    result: Result, model: str, count: int, want: str, good: Callable[[Any], bool]
) -> list[Any]:
    """The result's outputs, each checked to be what this endpoint answers with."""
    outputs = list(result.outputs or [])
    if len(outputs) != count or not all(good(o) for o in outputs):
        shape = KINDS.get(type(outputs[0]), "other") if outputs else "missing"
        raise invalid(f"model {model!r} does not answer {want} (its outputs: {shape})", "model")
    return outputs


def _is_vector(output: Any) -> bool:
    return isinstance(output, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in output
    )


def _is_number(output: Any) -> bool:
    return isinstance(output, int | float) and not isinstance(output, bool)


def _is_ranked(output: Any) -> bool:
    return isinstance(output, list) and all(
        isinstance(r, dict) and _is_int(r.get("index")) and _is_number(r.get("score"))
        for r in output
    )


def _is_classified(output: Any) -> bool:
    return isinstance(output, dict) and isinstance(output.get("scores"), dict)


def encode_base64(vector: Sequence[float]) -> str:
    """OpenAI's ``encoding_format: "base64"``: little-endian float32, base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _usage(result: Result) -> dict[str, int]:
    """OpenAI's embeddings ``usage``: the tokens the model took (no completion)."""
    tokens = result.usage.prompt_tokens if result.usage is not None else 0
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _listing(
    answered: Answered, model: str, data: list[dict[str, Any]], result: Result
) -> dict[str, Any]:
    """vLLM's ``{"id", "object": "list", "created", "model", "data", "usage"}``."""
    return {
        "id": answered.id,
        "object": "list",
        "created": answered.created,
        "model": model,
        "data": data,
        "usage": _usage(result),
    }


# --- /v1/embeddings (and /pooling) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Embed:
    model: str
    texts: list[str]
    base64: bool
    dimensions: int | None
    task: str | None


def _embed_request(body: Body, takes: frozenset[str] = frozenset()) -> _Embed:
    model = _check_fields(body, COMMON | {"input", "encoding_format", "dimensions"} | takes)
    if _given(body, "input") is None:
        raise invalid("input is required: a string or a list of strings", "input")
    texts = _texts(body["input"], "input")
    fmt = _given(body, "encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise invalid(f"encoding_format is float or base64, not {fmt!r}", "encoding_format")
    dims = _given(body, "dimensions")
    if dims is not None and not (_is_int(dims) and dims >= 1):
        raise invalid("dimensions is a positive integer", "dimensions")
    task = _given(body, "task")
    if task is not None and task not in ("embed", "classify"):
        raise invalid(f"task is embed or classify, not {task!r}", "task")
    return _Embed(model, texts, fmt == "base64", dims, task)


def _vectors(req: _Embed, outputs: list[list[float]]) -> list[list[float] | str]:
    if req.dimensions is not None and outputs and len(outputs[0]) != req.dimensions:
        raise invalid(
            f"model {req.model!r} answers {len(outputs[0])} dimensions, not {req.dimensions}: "
            "shortening vectors is not supported (it would not be truthful for a model not "
            "trained for it)",
            "dimensions",
        )
    return [encode_base64(v) if req.base64 else v for v in outputs]


def _embeddings_submission(body: Body) -> Submission:
    req = _embed_request(body)
    return Submission(req.model, {"inputs": req.texts})


def _embeddings_answer(body: Body, result: Result, answered: Answered) -> dict[str, Any]:
    req = _embed_request(body)
    outputs = _outputs(result, req.model, len(req.texts), "embeddings", _is_vector)
    data = [
        {"object": "embedding", "index": i, "embedding": e}
        for i, e in enumerate(_vectors(req, outputs))
    ]
    return _listing(answered, req.model, data, result)


def _pooling_submission(body: Body) -> Submission:
    req = _embed_request(body, frozenset({"task"}))
    return Submission(req.model, {"inputs": req.texts})


def _pooling_answer(body: Body, result: Result, answered: Answered) -> dict[str, Any]:
    """An embedding model's vectors; a classification model's probabilities."""
    req = _embed_request(body, frozenset({"task"}))
    first = (result.outputs or [None])[0]
    kind = req.task or ("classify" if _is_classified(first) else "embed")
    rows: list[Any]
    if kind == "classify":
        outputs = _outputs(result, req.model, len(req.texts), "classifications", _is_classified)
        probs = [list(o["scores"].values()) for o in outputs]
        rows = [encode_base64(p) if req.base64 else p for p in probs]
    else:
        rows = _vectors(req, _outputs(result, req.model, len(req.texts), "embeddings", _is_vector))
    data = [{"index": i, "object": "pooling", "data": d} for i, d in enumerate(rows)]
    return _listing(answered, req.model, data, result)


# --- /score, /v1/score -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Score:
    model: str
    first: list[str]
    second: list[str]

    @property
    def ranking(self) -> bool:
        """One text against many: submitted as one ranking (its documents' limit applies)."""
        return len(self.first) == 1


def _score_request(body: Body) -> _Score:
    names = [pair for pair in SCORE_NAMES if all(_given(body, n) is not None for n in pair)]
    if len(names) != 1:
        raise invalid(
            "give the texts to score as text_1 and text_2 (or queries and documents)", "text_1"
        )
    ((a, b),) = names
    model = _check_fields(body, COMMON | {a, b})
    first, second = _texts(_given(body, a), a), _texts(_given(body, b), b)
    if len(first) > 1 and len(first) != len(second):
        raise invalid(
            f"{a} and {b} are 1 to 1, 1 to N or N to N texts, not {len(first)} to {len(second)}", b
        )
    return _Score(model, first, second)


def _score_submission(body: Body) -> Submission:
    req = _score_request(body)
    if req.ranking:
        return Submission(req.model, {"query": req.first[0], "documents": req.second})
    return Submission(req.model, {"pairs": list(zip(req.first, req.second, strict=True))})


def _score_answer(body: Body, result: Result, answered: Answered) -> dict[str, Any]:
    req = _score_request(body)
    scores: list[float]
    if req.ranking:
        (ranked,) = _outputs(result, req.model, 1, "scores", _is_ranked)
        by_index = {r["index"]: r["score"] for r in ranked}
        if sorted(by_index) != list(range(len(req.second))):
            raise invalid(f"model {req.model!r} did not score every text", "model")
        scores = [by_index[i] for i in range(len(req.second))]
    else:
        scores = _outputs(result, req.model, len(req.first), "scores", _is_number)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return _listing(answered, req.model, data, result)


# --- /rerank, /v1/rerank, /v2/rerank -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rerank:
    model: str
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool


def _rerank_request(body: Body) -> _Rerank:
    model = _check_fields(body, COMMON | {"query", "documents", "top_n", "return_documents"})
    query = _given(body, "query")
    if not isinstance(query, str):
        raise invalid("query is a string", "query")
    documents = _texts(_given(body, "documents"), "documents")
    top_n = _given(body, "top_n")
    if top_n is not None and not (_is_int(top_n) and top_n >= 0):
        raise invalid("top_n is an integer >= 0 (0: every document)", "top_n")
    keep = _given(body, "return_documents")
    if keep is not None and not isinstance(keep, bool):
        raise invalid("return_documents is true or false", "return_documents")
    return _Rerank(model, query, documents, top_n or None, keep is not False)


def _rerank_submission(body: Body) -> Submission:
    req = _rerank_request(body)
    return Submission(
        req.model, {"query": req.query, "documents": req.documents, "top_n": req.top_n}
    )


def _rerank_answer(body: Body, result: Result, answered: Answered) -> dict[str, Any]:
    req = _rerank_request(body)
    (ranked,) = _outputs(result, req.model, 1, "rankings", _is_ranked)
    results: list[dict[str, Any]] = []
    for r in ranked:
        if not 0 <= r["index"] < len(req.documents):
            raise invalid(f"model {req.model!r} ranked a document that is not there", "model")
        item: dict[str, Any] = {"index": r["index"], "relevance_score": r["score"]}
        if req.return_documents:
            item["document"] = {"text": req.documents[r["index"]]}
        results.append(item)
    return {"id": answered.id, "model": req.model, "usage": _usage(result), "results": results}


# --- /classify --------------------------------------------------------------------------------


def _classify_request(body: Body) -> tuple[str, list[str]]:
    model = _check_fields(body, COMMON | {"input"})
    if _given(body, "input") is None:
        raise invalid("input is required: a string or a list of strings", "input")
    return model, _texts(body["input"], "input")


def _classify_submission(body: Body) -> Submission:
    model, texts = _classify_request(body)
    return Submission(model, {"inputs": texts})


def _classify_answer(body: Body, result: Result, answered: Answered) -> dict[str, Any]:
    model, texts = _classify_request(body)
    outputs = _outputs(result, model, len(texts), "classifications", _is_classified)
    data = []
    for i, out in enumerate(outputs):
        probs = list(out["scores"].values())
        data.append(
            {"index": i, "label": out.get("label"), "probs": probs, "num_classes": len(probs)}
        )
    return _listing(answered, model, data, result)


EMBEDDINGS = Endpoint(_embeddings_submission, _embeddings_answer, "embd", encoder=True)
POOLING = Endpoint(_pooling_submission, _pooling_answer, "pool", encoder=True)
SCORE = Endpoint(_score_submission, _score_answer, "score", encoder=True)
RERANK = Endpoint(_rerank_submission, _rerank_answer, "rerank", encoder=True)
CLASSIFY = Endpoint(_classify_submission, _classify_answer, "classify", encoder=True)

ENDPOINTS: dict[str, Endpoint] = {
    "/v1/embeddings": EMBEDDINGS,
    "/pooling": POOLING,
    "/score": SCORE,
    "/v1/score": SCORE,
    "/rerank": RERANK,
    "/v1/rerank": RERANK,
    "/v2/rerank": RERANK,
    "/classify": CLASSIFY,
}
"""URL path → endpoint: what vLLM's server offers for pooling models that batchfleet's
encoder runners can answer."""
