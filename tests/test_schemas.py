"""The wire contract: codec round trips, limits, and what bad entries turn into."""

from __future__ import annotations

import json

import msgpack
import pytest
from batchfleet.schemas.codec import (
    EntryRejected,
    decode_entry,
    decode_result,
    encode_request,
    encode_result,
)
from batchfleet.schemas.errors import ErrorCode
from batchfleet.schemas.keys import ModelKeys, check_model_name
from batchfleet.schemas.messages import ErrorInfo, Limits, Request, Result, Timings


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
