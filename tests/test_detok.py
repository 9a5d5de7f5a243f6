"""Incremental detokenization: broken characters are held, invalid bytes are not."""

from __future__ import annotations

from collections.abc import Sequence

from batchfleet.worker.generation.detok import TextStream


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
