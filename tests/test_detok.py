"""Incremental detokenization: the text released token by token is the text decoded at
once (byte-level BPE with multi-byte characters split over tokens); broken characters are
held, invalid bytes are not; stop strings are never released, even when they arrive
split over tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from batchfleet.worker.generation.detok import SETTLE, TextStream
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


def test_a_kept_stop_string_ends_the_text(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok("one two three four")["input_ids"]
    text = tok.decode(ids)
    # token by token, "two" completes first and ends the text, kept
    stream = TextStream(lambda t: tok.decode(list(t)), ("thr", "two thr", "two"), keep_stop=True)
    released = ""
    for i in ids:
        stream.extend([i])
        released += stream.delta()
    released += stream.delta(final=True)
    assert released == stream.final_text == text[: text.index("two") + 3]
    # all at once, "two thr" and "two" begin at the same place: the first given is kept
    stream = TextStream(lambda t: tok.decode(list(t)), ("thr", "two thr", "two"), keep_stop=True)
    stream.extend(ids)
    assert stream.delta(final=True) == stream.final_text == text[: text.index("two thr") + 7]


def decode(tokens: Sequence[int]) -> str:
    """One byte a token, decoded as byte-level tokenizers do (U+FFFD replaces bad bytes)."""
    return bytes(tokens).decode("utf-8", errors="replace")


def test_a_character_split_over_tokens_is_held_until_complete() -> None:
    s = TextStream(decode)
    s.extend(list(b"ab"))
    assert s.delta() == "ab"
    s.extend([0xE6, 0x97])  # the first two bytes of 日
    assert s.delta() == ""
    s.extend([0xA5])
    assert s.delta() == "日"
    assert s.final_text == "ab日"


def test_invalid_bytes_do_not_stall_the_stream() -> None:
    # Given a model that keeps emitting a byte no UTF-8 text can hold (0xC0)
    s = TextStream(decode)
    got = ""
    for _ in range(5):
        s.extend([0xC0])
        got += s.delta()

    # Then all but the last replacement character are released as they come, and the
    # final text is the whole decode
    assert got == "\ufffd" * 4
    assert s.final_text == decode([0xC0] * 5)
    assert got + s.delta(final=True) == s.final_text


def test_an_incomplete_character_at_the_end_is_in_the_final_text() -> None:
    s = TextStream(decode)
    s.extend([*b"ok", 0xE6])
    assert s.delta() == "ok"
    assert s.delta(final=True) == "\ufffd"
    assert s.final_text == "ok\ufffd"


def test_stop_strings_still_cut_the_text() -> None:
    s = TextStream(decode, stop=("END",))
    got = ""
    for b in b"abc END tail":
        s.extend([b])
        got += s.delta()
    got += s.delta(final=True)
    assert got == s.final_text == "abc "


def test_a_run_of_broken_bytes_keeps_the_decoded_window_short() -> None:
    # Given a model stuck on a lone UTF-8 lead byte (each one is broken by the next, and
    # the last is always incomplete, so the text always ends with a held U+FFFD)
    windows: list[int] = []

    def counting(tokens: Sequence[int]) -> str:
        windows.append(len(tokens))
        return decode(tokens)

    s = TextStream(counting)
    s.extend(list(b"ok "))
    got = s.delta()
    for _ in range(300):
        s.extend([0xE6])
        got += s.delta()

    # Then each token decodes a few tokens, not the whole run, and the text is unchanged
    assert max(windows[-50:]) <= 3 * SETTLE
    assert got == "ok " + "\ufffd" * 299
    assert got + s.delta(final=True) == s.final_text == decode([*b"ok ", *[0xE6] * 300])


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.lists(st.sampled_from([0x41, 0x20, 0xE6, 0x97, 0xA5, 0xC3, 0xA9, 0xF0, 0x9F, 0xC0]),
                 min_size=1, max_size=3),
        min_size=1, max_size=60,
    )
)  # fmt: skip
def test_any_bytes_in_any_chunks_release_the_whole_decode(data: list[list[int]]) -> None:
    s = TextStream(decode)
    got = ""
    for chunk in data:
        s.extend(chunk)
        got += s.delta()
    whole = decode([b for chunk in data for b in chunk])
    assert got + s.delta(final=True) == s.final_text == whole
