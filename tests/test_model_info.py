"""A model's published info (``bf:{model}:info``): its wire model, what runners say of
their model, and how a worker writes it (``created`` kept across restarts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Limits
from batchfleet.schemas.model_info import ModelInfo, decode_model_info
from batchfleet.worker.runner_info import model_info
from batchfleet.worker.streams import ModelStreams
from conftest import TINY_LM_OPTIONS
from pydantic import ValidationError


def test_a_later_workers_fields_are_ignored_and_task_is_required() -> None:
    raw = b'{"task": "text-generation", "max_model_len": 4096, "created": 5, "speculative": 3}'
    assert decode_model_info(raw) == ModelInfo(task="text-generation", max_model_len=4096,
                                               created=5)  # fmt: skip
    for bad in (b'{"max_model_len": 4096}', b"not json", b'{"task": "x", "max_model_len": 0}'):
        with pytest.raises(ValidationError):
            decode_model_info(bad)
    with pytest.raises(ValidationError):  # built in Python: checked like any wire model
        ModelInfo.model_validate({"task": "x", "speculative": 3})


def test_a_worker_writes_it_with_the_limits_keeping_when_it_was_first_published(
    r: redis.Redis,
) -> None:
    streams = ModelStreams(r, "m", 1, "w1")
    first = ModelInfo(task="embedding", max_model_len=64, created=1000)
    streams.ensure_groups(None, Limits(), first)
    assert decode_model_info(r.get(ModelKeys("m").info) or b"") == first
    # a later start (a bigger context now): the new info, first published at 1000 still
    streams.ensure_groups(None, Limits(), first.model_copy(update={"max_model_len": 128,
                                                                   "created": 2000}))  # fmt: skip
    again = decode_model_info(r.get(ModelKeys("m").info) or b"")
    assert (again.max_model_len, again.created) == (128, 1000)
    # one that is not ours is replaced whole; ``init-groups`` (no runner) writes none
    r.set(ModelKeys("m").info, b"garbage")
    streams.publish_info(first.model_copy(update={"created": 3000}))
    assert decode_model_info(r.get(ModelKeys("m").info) or b"").created == 3000
    ModelStreams(r, "n", 1, "init-groups").ensure_groups(None, Limits())
    assert r.get(ModelKeys("n").info) is None and r.get(ModelKeys("n").limits) is not None


def test_what_the_runners_say_of_their_model(tiny_lm: Path, tiny_embedder: Path) -> None:
    from batchfleet.worker.runners.embedding import EmbeddingRunner
    from batchfleet.worker.runners.generation import TextGenerationRunner

    # a generator: its context (the tiny Llama's 1024 positions, within its 2048-token
    # cache), its prompt bound, the limits' max_new_tokens, its chat template and parsers,
    # a thinking budget refused (no reasoning markers), a request's template untrusted
    lm = TextGenerationRunner(tiny_lm, device="cpu", dtype="float32", max_tokens=600,
                              options=TINY_LM_OPTIONS | {"tool_call_parser": "hermes"})  # fmt: skip
    info = model_info(lm, Limits(max_new_tokens=300), 7)
    assert info == ModelInfo(task="text-generation", max_model_len=1024, max_prompt_tokens=600,
                             max_new_tokens=300, default_max_new_tokens=256,
                             chat_template=True, tool_call_parser="hermes", beam_search=True,
                             thinking_token_budget=False, content_parts=True,
                             trust_request_chat_template=False, created=7)  # fmt: skip
    # the cache bounds it below the positions
    small = TextGenerationRunner(tiny_lm, device="cpu", dtype="float32",
                                 options=TINY_LM_OPTIONS | {"kv_cache_tokens": 512})  # fmt: skip
    assert model_info(small, Limits(), 7).max_model_len == 512
    # an encoder: its tokens per input
    enc = EmbeddingRunner(tiny_embedder, device="cpu", dtype="float32", max_tokens=64)
    assert model_info(enc, Limits(), 7) == ModelInfo(task="embedding", max_model_len=64,
                                                     created=7)  # fmt: skip


def test_a_custom_runner_is_described_by_what_it_has() -> None:
    class Custom:
        name = ""
        continuous = True
        context = "long"
        tool_call_parser = 3

    info = model_info(Custom(), Limits(), 7)  # type: ignore[arg-type]
    assert (info.task, info.max_model_len, info.tool_call_parser) == ("custom", None, None)
    assert (info.max_new_tokens, info.chat_template) == (4096, False)
