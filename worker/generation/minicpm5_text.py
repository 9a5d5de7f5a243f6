"""MiniCPM5's text cleaned up as vLLM's ``minicpm5`` tool parser cleans it before reading
it (``_normalize_model_output``, ``_strip_thinking_content``), for ``tool_choice``
``auto``:

- byte-level BPE artefacts decoded as they are, ``Ġ`` (U+0120) and ``Ċ`` (U+010A), are a
  space and a newline, in the calls and the content alike (``<functionĠname="f">`` is a
  call);
- tags written run together, ``<functionname=`` and ``<paramname=``, are
  ``<function name=`` and ``<param name=``;
- the content of the whole text is what follows its last ``</think>``, wherever it
  stands and whether or not the text opened it (``_strip_thinking_content``), trimmed at
  its start; where nothing follows, or there is none, the whole text.

Streamed, the pieces add up to the whole text's, a tag run together held back while it is
being written; the thinking is not taken out of the stream: vLLM's stream
(``extract_tool_calls_streaming``) strips none, and none could be stripped before the
text's end, where its last ``</think>`` is known. So, as vLLM's, a streamed reply's
``content`` keeps the thinking that the same reply's unstreamed ``content`` leaves out.
"""

from __future__ import annotations

from typing import Final

from .reasoning import held

THINK_END: Final = "</think>"
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
    """The content a trimmed text (so far; ``final``: whole) shows: the whole text's, what
    follows its last ``</think>``, trimmed (the whole text where nothing follows it); so
    far, the text as it is, as vLLM's stream."""
    if not final or THINK_END not in text:
        return text
    return text.rsplit(THINK_END, 1)[1].lstrip() or text
