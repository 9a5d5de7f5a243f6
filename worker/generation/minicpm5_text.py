"""MiniCPM5's text cleaned up as vLLM's ``minicpm5`` tool parser cleans it before reading
it (``_normalize_model_output``, ``_strip_thinking_content``), for ``tool_choice``
``auto``:

- byte-level BPE artefacts decoded as they are, ``Ġ`` (U+0120) and ``Ċ`` (U+010A), are a
  space and a newline, in the calls and the content alike (``<functionĠname="f">`` is a
  call);
- tags written run together, ``<functionname=`` and ``<paramname=``, are
  ``<function name=`` and ``<param name=``;
- the content is what follows the model's thinking: a text that begins with ``<think>``
  shows what follows its ``</think>`` (nothing while it thinks); where nothing follows,
  or the thinking never closes, the whole text, as vLLM's.

Streamed, the pieces add up to the whole text's: a tag run together is held back while it
is being written, and so is a text while it thinks. Differences, on purpose: vLLM's
strips up to the *last* ``</think>``, wherever it stands and whether or not the text
opened it, which a stream cannot know before its end (vLLM's own stream strips nothing);
here only a thinking the text begins with, up to its first ``</think>``.
"""

from __future__ import annotations

from typing import Final

from .reasoning import held

THINK, THINK_END = "<think>", "</think>"
_BPE: Final = str.maketrans({"\u0120": " ", "\u010a": "\n"})
_RUN_TOGETHER: Final = {"<functionname=": "<function name=", "<paramname=": "<param name="}


def clean(text: str, final: bool) -> str:
    """A text (so far; ``final``: whole) with its artefacts and run-together tags
    written out; so far, less an end that may be a run-together tag's start, so that each
    text so far cleaned is a start of the whole's."""
    while not final and (cut := max(held(text, tag) for tag in _RUN_TOGETHER)):
        text = text[:-cut]
    text = text.translate(_BPE)
    for run, spaced in _RUN_TOGETHER.items():
        text = text.replace(run, spaced)
    return text


def shown(text: str, final: bool) -> str:
    """The content a trimmed text (so far; ``final``: whole) shows: what follows a
    leading ``<think>``'s ``</think>``, trimmed (so far, nothing before it is written);
    the whole text where no thinking leads it, or none follows it at the end."""
    if not text.startswith(THINK):
        return "" if not final and THINK.startswith(text) else text
    at = text.find(THINK_END)
    rest = "" if at < 0 else text[at + len(THINK_END) :].lstrip()
    return rest if rest or not final else text
