"""The wire contract: codec round trips, limits, and what bad entries turn into."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from batchfleet.schemas.codec import (
    EntryRejected,
    decode_delta,
    decode_entry,
    decode_reply,
    decode_result,
    delta_fields,
    encode_delta,
    encode_request,
    encode_result,
    envelope_of,
)
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import ModelKeys, check_model_name
from batchfleet.schemas.messages import Delta, ErrorInfo, Limits, Request, Result, Timings


def _req(**kw: object) -> Request:
    body = {"id": "r1", "model": "m", "inputs": ["hello"], **kw}
    return Request.model_validate(body)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_request_round_trip(fmt: str) -> None:
    req = _req(deadline_ms=500, reply="chan", metadata={"k": "v"})
    fields = encode_request(req, fmt)  # type: ignore[arg-type]
    decoded, got_fmt = decode_entry(fields, "m")
    assert decoded == req
    assert got_fmt == fmt


def test_result_format_overrides_entry_format() -> None:
    req = _req(format="json")
    _, fmt = decode_entry(encode_request(req, "msgpack"), "m")
    assert fmt == "json"


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_result_round_trip(fmt: str) -> None:
    res = Result(
        id="r1",
        model="m",
        status="ok",
        outputs=[[0.5, -0.25]],
        truncated=[False],
        timings=Timings(queued_ms=1.5, batch_size=3, worker="w"),
    )
    assert decode_result(encode_result(res, fmt)) == res  # type: ignore[arg-type]


def test_error_result_round_trip_keeps_code() -> None:
    res = Result(
        id="r1", model="m", status="error", error=ErrorInfo(code="too_large", message="x" * 5000)
    )
    back = decode_result(encode_result(res))
    assert back.error is not None and back.error.code is ErrorCode.TOO_LARGE
    assert len(back.error.message) <= 1000


def _fields(body: object, fmt: str = "msgpack") -> dict[bytes, bytes]:
    if fmt == "json":
        return {b"json": json.dumps(body).encode()}
    return {b"msgpack": msgpack.packb(body)}


GOOD = {"id": "abc", "model": "m", "inputs": ["hi"]}


@pytest.mark.parametrize(
    ("fields", "code", "answerable"),
    [
        ({b"msgpack": b"\xc1\xc1"}, ErrorCode.MALFORMED, False),
        ({b"json": b"{not json"}, ErrorCode.MALFORMED, False),
        ({b"other": b"x"}, ErrorCode.MALFORMED, False),
        (_fields([1, 2, 3]), ErrorCode.MALFORMED, False),
        (_fields({**GOOD, "model": "other"}), ErrorCode.UNKNOWN_MODEL, True),
        (_fields({**GOOD, "inputs": []}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "inputs": ["  "]}), ErrorCode.EMPTY_INPUT, True),
        (_fields({**GOOD, "inputs": ["x" * 30_000]}), ErrorCode.TOO_LARGE, True),
        (_fields({**GOOD, "inputs": ["a"] * 65}), ErrorCode.TOO_LARGE, True),
        (_fields({**GOOD, "inputs": "not a list"}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "surprise": 1}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "deadline_ms": -5}), ErrorCode.INVALID_REQUEST, True),
        (_fields({"model": "m", "inputs": ["hi"]}), ErrorCode.INVALID_REQUEST, False),
        (_fields({**GOOD, "id": "bad id with spaces"}), ErrorCode.INVALID_REQUEST, False),
        (_fields({**GOOD, "v": 2}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "inputs": [1]}, "json"), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "repetition_penalty": 0.0}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "repetition_penalty": 11.0}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "presence_penalty": -2.5}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "frequency_penalty": 2.5}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "min_new_tokens": -1}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "min_new_tokens": 5000}), ErrorCode.TOO_LARGE, True),
        (_fields({**GOOD, "logprobs": 21}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "stop_token_ids": [-1]}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "stop_token_ids": [2**31]}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "stop_token_ids": list(range(65))}), ErrorCode.TOO_LARGE, True),
        (_fields({**GOOD, "logprobs": -1}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "logit_bias": {"5": 101.0}}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "logit_bias": {"-5": 1.0}}, "json"), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "logit_bias": {"x": 1.0}}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "ignore_eos": 1}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "min_p": 1.5}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "min_p": -0.1}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "truncate_prompt_tokens": 0}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "prompt_logprobs": 21}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "include_stop_str_in_output": "yes"}), ErrorCode.INVALID_REQUEST, True),
        (_fields({**GOOD, "logit_bias": {"1": "2"}}), ErrorCode.INVALID_REQUEST, True),
        (
            _fields({**GOOD, "logit_bias": {str(t): 1.0 for t in range(301)}}),
            ErrorCode.TOO_LARGE,
            True,
        ),
        (
            _fields({**GOOD, "min_new_tokens": 9, "max_new_tokens": 8}),
            ErrorCode.INVALID_REQUEST,
            True,
        ),
    ],
)
def test_bad_entries_are_rejected_with_a_stable_code(
    fields: dict[bytes, bytes], code: ErrorCode, answerable: bool
) -> None:
    with pytest.raises(EntryRejected) as info:
        decode_entry(fields, "m")
    assert info.value.code is code
    assert info.value.envelope.answerable is answerable


def test_oversized_entry_is_rejected_before_decoding() -> None:
    limits = Limits(max_entry_bytes=1024)
    with pytest.raises(EntryRejected) as info:
        decode_entry({b"msgpack": b"\x00" * 2000}, "m", limits)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_msgpack_ext_types_and_binary_are_refused() -> None:
    ext = msgpack.packb({**GOOD, "metadata": {"k": msgpack.ExtType(1, b"x")}})
    with pytest.raises(EntryRejected) as info:
        decode_entry({b"msgpack": ext}, "m")
    assert info.value.code is ErrorCode.MALFORMED


def test_reply_target_is_kept_for_an_invalid_request() -> None:
    body = {**GOOD, "inputs": [], "reply": "my-channel", "metadata": {"trace": "t1"}}
    with pytest.raises(EntryRejected) as info:
        decode_entry(_fields(body), "m")
    env = info.value.envelope
    assert (env.id, env.reply, env.metadata) == ("abc", "my-channel", {"trace": "t1"})


def test_keys_share_the_model_hash_tag() -> None:
    keys = ModelKeys("minilm")
    names = [keys.lane(0), keys.lane(2), keys.result("x"), keys.dead, keys.workers, keys.lanes_key]
    assert all("{minilm}" in n for n in names)
    assert keys.lane(1) == "bf:{minilm}:lane:1"
    assert keys.result("abc") == "bf:{minilm}:result:abc"


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "{tag}", "-lead"])
def test_bad_model_names(name: str) -> None:
    with pytest.raises(ValueError):
        check_model_name(name)


# --- strict wire validation (issue #15) -----------------------------------------------------


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize(
    "bad",
    [
        {"deadline_ms": "60000"},  # a numeric string for an int
        {"deadline_ms": True},  # a bool for an int
        {"deadline_ms": 60000.0},  # a float for an int
        {"result_ttl_s": "60"},
        {"v": True},
        {"v": 1.0},
        {"id": ["abc"]},  # a list for a string
        {"id": 123},
        {"inputs": "hi"},  # a string for a list
        {"inputs": [["hi"]]},
        {"reply": 5},
        {"metadata": {"k": 1}},
        {"metadata": [["k", "v"]]},
        {"webhook": {"url": ["https://example.com/hook"]}},
    ],
)
def test_wrong_types_are_invalid_requests_not_coerced(fmt: str, bad: dict[str, object]) -> None:
    with pytest.raises(EntryRejected) as info:
        decode_entry(_fields({**GOOD, **bad}, fmt), "m")
    assert info.value.code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_strict_validation_keeps_every_valid_field(fmt: str) -> None:
    body = {**GOOD, "v": 1, "deadline_ms": 60000, "reply": "c", "result_ttl_s": 60,
            "format": "json", "metadata": {"k": "v"},
            "webhook": {"url": "https://example.com/h", "secret_id": "s1", "format": "msgpack"}}  # fmt: skip
    request, got = decode_entry(_fields(body, fmt), "m")
    assert request.deadline_ms == 60000 and request.webhook is not None and got == "json"
    rules = {"repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 2.0,
             "min_new_tokens": 4, "logprobs": 20, "max_new_tokens": 4,
             "logit_bias": {str(t): (t - 150) / 2 for t in range(0, 300, 3)}, "n": 3,
             "ignore_eos": True, "min_p": 0.05, "include_stop_str_in_output": True,
             "truncate_prompt_tokens": 100, "prompt_logprobs": 5}  # fmt: skip
    request, _ = decode_entry(_fields({**GOOD, **rules}, fmt), "m")
    assert {k: getattr(request, k) for k in rules} == rules
    assert request.generation_fields() == ["max_new_tokens", *list(rules)[:5], "n", "logit_bias",
                                           "ignore_eos", "min_p", "include_stop_str_in_output",
                                           "truncate_prompt_tokens", "prompt_logprobs"]  # fmt: skip


# --- oversized entries still get an answer when their id can be read (issue #15) ------------


BIG = {"id": "big-1", "model": "m", "inputs": ["x" * 5000, "y"], "deadline_ms": 5,
       "reply": "chan", "format": "json", "metadata": {"trace": "t1"},
       "webhook": {"url": "https://example.com/h"}}  # fmt: skip


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("order", ["id first", "id last"])
def test_oversized_entry_with_a_readable_id_is_answerable(fmt: str, order: str) -> None:
    body = BIG if order == "id first" else {**{k: v for k, v in BIG.items() if k != "id"},
                                            "id": "big-1"}  # fmt: skip
    with pytest.raises(EntryRejected) as info:
        decode_entry(_fields(body, fmt), "m", Limits(max_entry_bytes=1024))
    assert info.value.code is ErrorCode.TOO_LARGE
    env = info.value.envelope
    assert (env.id, env.reply, env.format, env.metadata) == (
        "big-1",
        "chan",
        "json",
        {"trace": "t1"},
    )


@pytest.mark.parametrize(
    "fields",
    [
        _fields({k: v for k, v in BIG.items() if k != "id"}),
        _fields({k: v for k, v in BIG.items() if k != "id"}, "json"),
        {b"msgpack": b"\x00" * 2000},  # not a map
        {b"json": b"[" * 2000},
        {b"json": b'{"inputs": "' + b"x" * 2000},  # unterminated before the id
        {b"msgpack": msgpack.packb({"inputs": ["x" * 3000], "id": "bad id"})},
    ],
)
def test_oversized_entry_without_a_readable_id_is_not_answerable(
    fields: dict[bytes, bytes],
) -> None:
    with pytest.raises(EntryRejected) as info:
        decode_entry(fields, "m", Limits(max_entry_bytes=1024))
    assert info.value.code is ErrorCode.TOO_LARGE
    assert not info.value.envelope.answerable


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_envelope_of_an_oversized_poison_entry_keeps_its_id(fmt: str) -> None:
    """The poison path (worker: envelope_of, then answered ``poisoned``) reads it the same."""
    env = envelope_of(_fields(BIG, fmt), Limits(max_entry_bytes=1024))
    assert (env.id, env.reply, env.metadata) == ("big-1", "chan", {"trace": "t1"})


def test_oversized_entry_envelope_skips_big_values_it_cannot_decode() -> None:
    """Limits bound what is decoded: a 2 MB string or a 100,000-item array is skipped."""
    body = {"inputs": ["x" * 10] * 100_000, "blob": "z" * 2_000_000, "id": "r-9"}
    with pytest.raises(EntryRejected) as info:
        decode_entry(_fields(body), "m")
    assert info.value.envelope.id == "r-9"


# --- tolerant reading of results (issue #12) ------------------------------------------------


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_results_from_a_later_v1_worker_are_read(fmt: str) -> None:
    body = {"v": 1, "id": "r1", "model": "m", "status": "deferred", "queue_position": 3,
            "error": {"code": "overloaded", "message": "later", "retry_after_ms": 5},
            "timings": {"queued_ms": 1.0, "gpu_ms": 2.0}}  # fmt: skip
    raw = json.dumps(body).encode() if fmt == "json" else msgpack.packb(body)
    for result in (decode_result(raw), decode_reply(raw)):
        assert result is not None
        assert result.status == "deferred" and not result.ok
        assert result.error is not None and result.error.code == "overloaded"
        assert result.timings.queued_ms == 1.0


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_a_generation_s_logprobs_are_read_and_unknown_fields_in_them_ignored(fmt: str) -> None:
    top = [{"token": 7, "text": "a", "logprob": -0.1, "rank": 1}, {"token": 9, "text": "b",
                                                                   "logprob": -2.5}]  # fmt: skip
    out = {"text": "a", "finish_reason": "length", "completion_tokens": 1,
           "logprobs": [{"token": 7, "text": "a", "logprob": -0.1, "top": top, "bytes": [97]}]}  # fmt: skip
    body = {"v": 1, "id": "r1", "model": "m", "status": "ok", "outputs": [out, {**out}]}
    raw = json.dumps(body).encode() if fmt == "json" else msgpack.packb(body)
    result = decode_result(raw)
    (gen, _) = result.generations()
    assert gen.logprobs is not None and gen.logprobs[0].logprob == -0.1
    assert [(t.token, t.logprob) for t in gen.logprobs[0].top] == [(7, -0.1), (9, -2.5)]
    del out["logprobs"]
    assert decode_result(msgpack.packb(body)).generations()[0].logprobs is None  # older workers
    out["prompt_logprobs"] = [None, {"token": 9, "text": "b", "logprob": -1.5, "top": top}]
    raw = json.dumps(body).encode() if fmt == "json" else msgpack.packb(body)
    (gen, _) = decode_result(raw).generations()
    assert gen.prompt_logprobs is not None and gen.prompt_logprobs[0] is None
    assert gen.prompt_logprobs[1] is not None and gen.prompt_logprobs[1].logprob == -1.5


def test_results_built_in_python_are_still_checked() -> None:
    with pytest.raises(ValueError):
        Result(id="r1", model="m", status="deferred")
    with pytest.raises(ValueError):
        Result(id="r1", model="m", status="ok", surprise=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        ErrorInfo(code="overloaded", message="x")


@pytest.mark.parametrize(
    "message",
    [
        json.dumps({"kind": "progress", "id": "r1", "done": 3}).encode(),
        msgpack.packb({"kind": "progress", "id": "r1", "status": "ok"}),
        msgpack.packb({"v": 2, "id": "r1", "model": "m", "status": "ok"}),
        json.dumps({"hello": "world"}).encode(),
        b"\xc1",
        b"{not json",
        msgpack.packb([1, 2]),
    ],
)
def test_reply_channel_messages_that_are_not_results_are_skipped(message: bytes) -> None:
    assert decode_reply(message) is None


LOGPROBS = [
    {"token": 5, "text": " caf", "logprob": -0.25, "top": [{"token": 5, "text": " caf", "logprob": -0.25}]},
    {"token": 9, "text": "\u00e9", "logprob": 0.0, "top": []},
]  # fmt: skip


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("logprobs", [None, LOGPROBS])
def test_a_delta_message_is_its_model_dump_and_decodes_back(
    fmt: str, logprobs: list[dict[str, Any]] | None
) -> None:
    delta = Delta(id="r1", model="smollm", seq=3, input=1, text=" caf\u00e9", tokens=2,
                  logprobs=logprobs)  # fmt: skip
    raw = encode_delta(delta, fmt)  # type: ignore[arg-type]
    body = json.loads(raw) if fmt == "json" else msgpack.unpackb(raw)
    assert body == delta.model_dump(mode="json", exclude_none=True)  # no logprobs: no key
    assert decode_delta(body) == delta
    fields = delta_fields(delta)
    assert (b"logprobs" in fields) == (logprobs is not None)
    # a later worker's fields, top-level and nested, are ignored
    later = body | {"later": 1}
    if logprobs is not None:
        later["logprobs"] = [t | {"later": 2} for t in body["logprobs"]]
    decoded, known = decode_delta(later), decode_delta(body)
    assert decoded == delta and known is not None
    assert decoded is not None and decoded.model_fields_set == known.model_fields_set
    if logprobs is not None:
        assert json.loads(fields[b"logprobs"]) == logprobs
