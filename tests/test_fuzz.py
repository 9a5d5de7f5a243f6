"""Random and mutated stream entries: the decoder never crashes, and through the real
worker loop (real redis-server) every entry gets a result or a dead-letter entry."""

from __future__ import annotations

import base64
import json
import string
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from batchfleet.schemas.codec import EntryRejected, decode_entry
from batchfleet.schemas.keys import GROUP, ModelKeys
from batchfleet.schemas.messages import Limits
from batchfleet.worker.loop import BatchLoop
from batchfleet.worker.runners.embedding import EmbeddingRunner
from devices import DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_vision import image_file

from batchfleet.config import ModelConfig, WorkerConfig

MODEL = "fuzz"
KEYS = ModelKeys(MODEL)
LIMITS = Limits(max_entry_bytes=4096, max_inputs=8, max_text_chars=200)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=30), st.binary(max_size=30),
)  # fmt: skip
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip
ids = st.text(alphabet=string.ascii_letters + string.digits + "-_:.", min_size=1, max_size=20)
PNG = image_file(6, 4)
one_input = st.one_of(
    st.text(min_size=1, max_size=40),
    st.binary(max_size=64),  # image bytes (msgpack bin), mostly not images
    st.sampled_from([PNG, PNG[:20], image_file(3, 3, "JPEG"), image_file(3, 3, "GIF")]),
    st.builds(lambda b: {"image_b64": base64.b64encode(b).decode()}, st.binary(max_size=48)),
    st.builds(lambda n: {"image_key": f"bf:{{{MODEL}}}:input:{n}"}, ids),
    st.builds(lambda a, b: {"text": a, "text_pair": b}, st.text(max_size=20), st.text(max_size=20)),
    st.builds(
        lambda q, d: {"query": q, "documents": d},
        st.text(max_size=20),
        st.lists(st.text(max_size=10), max_size=4),
    ),
)
valid = st.fixed_dictionaries(
    {"id": ids, "model": st.just(MODEL), "inputs": st.lists(one_input, min_size=1, max_size=4)},
    optional={
        "deadline_ms": st.integers(-5, 10**9), "reply": st.text(max_size=20), "v": st.integers(0, 3),
        "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
        "format": st.sampled_from(["msgpack", "json", "xml"]), "result_ttl_s": st.integers(-1, 10**7),
    },
)  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn) -> dict[bytes, bytes]:
    """A valid-looking request with some fields replaced by anything, then maybe bit-flipped."""
    body: dict[str, Any] = draw(valid)
    for key in draw(
        st.lists(
            st.sampled_from(["id", "model", "inputs", "deadline_ms", "reply", "x"]), max_size=2
        )
    ):
        body[key] = draw(values)
    fmt = draw(st.sampled_from(["msgpack", "json"]))
    try:
        raw = (
            msgpack.packb(body, use_bin_type=True)
            if fmt == "msgpack"
            else json.dumps(body).encode()
        )
    except (TypeError, ValueError, OverflowError):
        raw = msgpack.packb({"id": "x", "model": MODEL, "inputs": 5})
    flips = draw(st.lists(st.integers(0, max(0, len(raw) - 1)), max_size=3))
    data = bytearray(raw)
    for pos in flips:
        data[pos] ^= 0xFF
    return {fmt.encode(): bytes(data)}


entries = st.one_of(
    mutated(),
    st.dictionaries(st.binary(max_size=10), st.binary(max_size=200), max_size=3),
    st.builds(lambda b: {b"msgpack": b}, st.binary(max_size=300)),
    st.builds(lambda v: {b"msgpack": msgpack.packb(v)}, values),
    st.builds(lambda b: {b"json": b}, st.binary(max_size=200)),
)


def check_decoder(fields: dict[bytes, bytes]) -> None:
    """The decoder returns a bounded, valid request or a rejection with a code; nothing else."""
    try:
        request, fmt = decode_entry(fields, MODEL, LIMITS)
    except EntryRejected as exc:
        assert exc.code.value and str(exc)
    else:
        assert request.model == MODEL and fmt in ("msgpack", "json")
        assert 1 <= len(request.inputs) <= LIMITS.max_inputs


@pytest.fixture(scope="module")
def handler(tiny_embedder: Path) -> EmbeddingRunner:
    return EmbeddingRunner(tiny_embedder, device=DEVICE, max_tokens=32)


def test_10000_fuzzed_entries_through_the_decoder_and_the_worker_loop(
    r: redis.Redis, handler: EmbeddingRunner
) -> None:
    # Given 10,000 random and mutated entries, each checked against the decoder
    seen: list[dict[bytes, bytes]] = []

    @settings(max_examples=10_000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(entries)
    def decode(fields: dict[bytes, bytes]) -> None:
        check_decoder(fields)
        seen.append(fields)

    decode()
    total = len(seen)
    assert total >= 10_000

    # When all of them go through a real worker loop
    cfg = ModelConfig(path="/unused", max_tokens=32, limits=LIMITS)
    loop = BatchLoop(
        MODEL, cfg, handler, r, consumer="fuzzer", worker=WorkerConfig(block_ms=20), burst=True
    )
    loop.streams.ensure_groups()
    pipe = r.pipeline(transaction=False)
    for i, fields in enumerate(seen):
        pipe.xadd(KEYS.lane(i % 3), fields or {b"empty": b""})
    pipe.execute()
    loop.run()  # burst: returns once every stream is drained

    # Then none crashed it, and each was answered (a result) or dead-lettered
    stats = loop.stats.snapshot()
    answered = sum(stats["requests"].values())
    dead = r.xlen(KEYS.dead)
    assert sum(r.xlen(KEYS.lane(i)) for i in range(3)) == 0, "every entry retired"
    assert all(r.xpending(KEYS.lane(i), GROUP)["pending"] == 0 for i in range(3))
    assert answered + dead == total, (stats, dead, total)
    print(f"fuzz: {total} entries, {answered} answered ({stats['requests']}), {dead} dead-lettered")
