"""Splitting a unary request over fleet requests, and merging their results."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
from batchfleet.producer.gateway.endpoint import Submission
from batchfleet.producer.gateway.errors import ApiError
from batchfleet.producer.gateway.split import MAX_INPUTS, merged, part_ids, split
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.messages import ErrorInfo, Limits, Result, Usage
from gateway_fakes import ScriptedWorker, gateway_in_process, http


def test_a_request_within_the_limits_goes_whole() -> None:
    sub = Submission("m", {"inputs": ["a"] * 64, "priority": 0})
    assert split(sub, 64, 1 << 20) == [sub]
    ranking = Submission("r", {"query": "q", "documents": ["d"] * 200})
    assert split(ranking, 64, 1 << 20) == [ranking]


def test_more_inputs_than_max_inputs_go_in_parts_in_order() -> None:
    texts = [f"t{i}" for i in range(150)]
    parts = split(Submission("m", {"inputs": texts, "priority": 2}), 64, 1 << 20)
    assert [len(p.options["inputs"]) for p in parts] == [64, 64, 22]
    assert [t for p in parts for t in p.options["inputs"]] == texts
    assert all(p.model == "m" and p.options["priority"] == 2 for p in parts)


def test_pairs_split_too_and_long_texts_split_by_bytes() -> None:
    pairs = [("q", f"d{i}") for i in range(65)]
    assert [len(p.options["pairs"]) for p in split(Submission("m", {"pairs": pairs}),
                                                    64, 1 << 20)] == [64, 1]  # fmt: skip
    texts = ["é" * 500] * 5  # 1,000 bytes each in UTF-8
    parts = split(Submission("m", {"inputs": texts}), 64, 4096)  # 2,048 bytes a part
    assert [len(p.options["inputs"]) for p in parts] == [2, 2, 1]
    huge = ["x" * 10_000, "y"]  # over the budget alone: goes alone (the producer judges it)
    assert [p.options["inputs"] for p in split(Submission("m", {"inputs": huge}), 64, 4096)] == [
        ["x" * 10_000], ["y"]]  # fmt: skip


def test_more_than_openais_bound_is_refused() -> None:
    with pytest.raises(ApiError) as info:
        split(Submission("m", {"inputs": ["a"] * (MAX_INPUTS + 1)}), 64, 1 << 20)
    assert (info.value.status, info.value.code, info.value.param) == (400, "too_large", "input")


def test_part_ids() -> None:
    assert part_ids("abc", 1) == ["abc"]
    assert part_ids("abc", 3) == ["abc.0", "abc.1", "abc.2"]
    assert part_ids("x" * 126, 10)[-1] == "x" * 126 + ".9"
    with pytest.raises(ApiError) as info:
        part_ids("x" * 127, 10)  # x...x.9 would be 129 characters
    assert info.value.param == "request_id" and "at most 126" in info.value.message


def _ok(outputs: list[list[float]], tokens: int | None, truncated: list[bool] | None) -> Result:
    usage = Usage(prompt_tokens=tokens) if tokens is not None else None
    return Result(id="p", model="m", status="ok", outputs=outputs, usage=usage,
                  truncated=truncated)  # fmt: skip


def test_merged_results_keep_the_order_and_sum_the_tokens() -> None:
    one = _ok([[1.0], [2.0]], 5, [False, True])
    assert merged([one]) is one
    both = merged([one, _ok([[3.0]], 4, [False])])
    assert both.outputs == [[1.0], [2.0], [3.0]] and both.truncated == [False, True, False]
    assert both.usage is not None and both.usage.prompt_tokens == 9 and both.ok
    old = merged([_ok([[1.0]], None, None), _ok([[2.0]], None, None)])  # older workers
    assert old.usage is None and old.truncated is None and old.outputs == [[1.0], [2.0]]


def test_a_part_that_fails_fails_the_answer_and_cancels_the_others(redis_url: str) -> None:
    """The gateway in-process against a real Redis; the test plays the worker."""
    client = redis.Redis.from_url(redis_url)
    fake = ScriptedWorker(client, "splitm", Limits(max_inputs=2))

    async def go() -> None:
        async with gateway_in_process(redis_url) as port:
            # Given 5 texts for a model that takes 2 a request: 3 fleet requests
            ask = asyncio.ensure_future(http(port, "POST", "/v1/embeddings",
                                             {"model": "splitm", "input": list("abcde")}))  # fmt: skip
            taken = [await asyncio.to_thread(fake.take) for _ in range(3)]
            part = {t.id.rsplit(".", 1)[1]: t for t in taken}
            assert sorted(part) == ["0", "1", "2"]
            # When part 0 is answered and part 1 fails
            await asyncio.to_thread(fake.ok, part["0"], [[1.0], [2.0]])
            error = ErrorInfo(code=ErrorCode.INVALID_INPUT, message="inputs[1]: no good")
            failed = Result(id=part["1"].id, model="splitm", status="error", error=error)
            await asyncio.to_thread(fake.answer, part["1"], failed)
            # Then the answer is part 1's error, and part 2 (still running) is cancelled
            status, body = await ask
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_input"
            for _ in range(100):
                if await asyncio.to_thread(fake.cancelled, part["2"]):
                    break
                await asyncio.sleep(0.05)
            assert await asyncio.to_thread(fake.cancelled, part["2"])

    try:
        asyncio.run(go())
    finally:
        client.close()
