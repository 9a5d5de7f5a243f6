"""A reasoning model's text split into its reasoning and its answer (vLLM's reasoning
parsers, chosen by the model's ``reasoning_parser`` option):

- ``deepseek_r1``: the text up to ``</think>`` is reasoning (a leading ``<think>`` left
  out: DeepSeek-R1's template opens it in the prompt); a text without ``</think>`` is all
  reasoning (cut while thinking);
- ``qwen3``: the same, but a text without ``</think>`` is all answer (Qwen3 with
  thinking off writes none; its thinking models, whose template opens ``<think>`` in the
  prompt, write no opening one).

The answer is where tool calls are read, so a call the model only thought about is not
made; until ``</think>`` comes, none is read (for ``qwen3`` without it: at the end). A
request's constraint begins after ``</think>`` (``Sampling.constraint_after``).
"""

from __future__ import annotations

from typing import Final

REASONING_PARSERS: Final = ("deepseek_r1", "qwen3")
"""The values of a model's ``reasoning_parser`` option."""
REASONING_MARKERS: Final = ("<think>", "</think>")
_OPEN, _CLOSE = REASONING_MARKERS


def answer_start(parser: str, text: str, final: bool) -> int | None:
    """Where the answer begins in ``text`` (a text so far; ``final``: all of it); None
    while that is not known yet (it may still be reasoning)."""
    end = text.find(_CLOSE)
    if end >= 0:
        return end + len(_CLOSE)
    if final:
        return len(text) if parser == "deepseek_r1" else 0
    return None


def split(parser: str, text: str) -> tuple[str | None, str]:
    """A whole text's reasoning (None: none) and its answer."""
    start = answer_start(parser, text, final=True)
    assert start is not None
    if start == 0:
        return None, text
    reasoning = text[:start]
    if reasoning.endswith(_CLOSE):
        reasoning = reasoning[: -len(_CLOSE)]
    head = reasoning.lstrip()
    if head.startswith(_OPEN):
        reasoning = head[len(_OPEN) :]
    return reasoning.strip(), text[start:]
