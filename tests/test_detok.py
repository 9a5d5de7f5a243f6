"""Incremental detokenization: the text released token by token is the text decoded at
once (byte-level BPE with multi-byte characters split over tokens), and stop strings
are never released, even when they arrive split over tokens."""

from __future__ import annotations

import pytest
from batchfleet.worker.generation.detok import TextStream
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_causal_lm


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_causal_lm(tmp_path_factory.mktemp("lm")))


TEXTS = ["the man was here", "héllo wörld ünïcode ✓ 日本 and more", "a  b\n\nc", "日本日本✓✓"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_released_text_is_the_whole_decode(tok, text: str, chunk: int) -> None:  # type: ignore[no-untyped-def]
    ids = tok(text)["input_ids"]
    stream = TextStream(lambda t: tok.decode(list(t)))
    out = ""
    for i in range(0, len(ids), chunk):
        stream.extend(ids[i : i + chunk])
        piece = stream.delta()
        assert "\ufffd" not in piece
        out += piece
    out += stream.delta(final=True)
    assert out == tok.decode(ids) == stream.final_text


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(alphabet="ab c✓日", min_size=1, max_size=30),
    stop=st.sampled_from(["c ", "✓日", "bb"]),
)
def test_a_stop_string_is_never_released(tok, text: str, stop: str) -> None:  # type: ignore[no-untyped-def]
    ids = tok(text)["input_ids"]
    stream = TextStream(lambda t: tok.decode(list(t)), (stop,))
    released = ""
    for i in ids:
        stream.extend([i])
        released += stream.delta()
    released += stream.delta(final=True)
    whole = tok.decode(ids)
    expected = whole[: whole.find(stop)] if stop in whole else whole
    assert released == stream.final_text == expected
    assert stop not in released
