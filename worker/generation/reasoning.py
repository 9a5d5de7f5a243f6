"""A reasoning model's text split into its reasoning and its answer (vLLM's reasoning
parsers, chosen by the model's ``reasoning_parser`` option).

Whether a text begins in its reasoning (``thinking``) is read off the prompt's end
(:func:`opens`): a prompt that leaves ``<think>`` open (DeepSeek-R1's template, Qwen3's
thinking models) begins it; one that closes it (Qwen3 with ``enable_thinking`` false writes
an empty ``<think></think>``) does not. Otherwise the parser decides:

- ``deepseek_r1``: the text begins in its reasoning (a leading ``<think>`` left out);
- ``qwen3``: only where it begins with ``<think>`` (Qwen3 with thinking on); else it is
  all answer.

A text that begins in its reasoning is reasoning up to its first ``</think>``, and all
reasoning without one (cut while thinking). The answer is where tool calls are read, so a
call the model only thought about is not made; until ``</think>`` comes, none is read. A
request's constraint begins after ``</think>`` (``Sampling.constraint_after``), or from the
first token where the prompt closed the reasoning.

Streamed, each delta carries the reasoning and the answer it adds
(:func:`reasoning_so_far`): held back are a possible ``<think>`` or ``</think>`` being
written, and trailing whitespace, so that the deltas' pieces add up to the result's
``reasoning_content``.
"""

from __future__ import annotations

from typing import Final

REASONING_PARSERS: Final = ("deepseek_r1", "qwen3")
"""The values of a model's ``reasoning_parser`` option."""
REASONING_MARKERS: Final = ("<think>", "</think>")
_OPEN, _CLOSE = REASONING_MARKERS


def opens(parser: str, prompt_end: str) -> bool | None:
    """Whether the text after a prompt ending ``prompt_end`` begins in its reasoning
    (None: the text's own start tells, see the module docstring)."""
    tail = prompt_end.rstrip()
    if tail.endswith(_OPEN):
        return True
    if tail.endswith(_CLOSE):
        return False
    return True if parser == "deepseek_r1" else None


def answer_start(text: str, final: bool, thinking: bool | None) -> int | None:
    """Where the answer begins in ``text`` (a text so far; ``final``: all of it); None
    while that is not known yet (it may still be reasoning)."""
    if thinking is None:  # the text's start tells
        head = text.lstrip()
        if not head.startswith(_OPEN):
            return None if not final and _OPEN.startswith(head) else 0
    elif not thinking:
        return 0
    end = text.find(_CLOSE)
    if end >= 0:
        return end + len(_CLOSE)
    return len(text) if final else None


def split(text: str, thinking: bool | None) -> tuple[str | None, str]:
    """A whole text's reasoning (None: none) and its answer."""
    start = answer_start(text, True, thinking)
    assert start is not None
    if start == 0:
        return None, text
    return _clean(text[:start]), text[start:]


def reasoning_so_far(text: str, thinking: bool | None) -> str:
    """The reasoning a text so far shows for certain: the start of the whole text's
    reasoning (:func:`split`), whatever follows."""
    start = answer_start(text, False, thinking)
    if start == 0:
        return ""
    if start is not None:
        return _clean(text[:start])
    if thinking is None and not text.lstrip().startswith(_OPEN):
        return ""  # not known yet to be reasoning
    body = text[: len(text) - held(text, _CLOSE)]
    head = body.lstrip()
    if not head.startswith(_OPEN) and _OPEN.startswith(head):
        return ""  # perhaps <think> being written
    return _clean(body)


def _clean(reasoning: str) -> str:
    if reasoning.endswith(_CLOSE):
        reasoning = reasoning[: -len(_CLOSE)]
    head = reasoning.lstrip()
    if head.startswith(_OPEN):
        reasoning = head[len(_OPEN) :]
    return reasoning.strip()


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker`` (the longest end
    that is a proper prefix of it; 0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
