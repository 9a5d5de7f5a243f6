"""The message-block formats: models whose text is typed blocks, reasoning, answer and
calls in any order, each read by one parser for all three (vLLM's ``inkling`` and
``muse_glimmer`` reasoning and tool parsers; :mod:`.inkling`, :mod:`.muse_glimmer`).

As Cohere Command's, such a text is all answer to the split (:class:`BlocksReasoning`:
its reasoning is its reasoning blocks', wherever they are), its content is its format's
(:meth:`Format.content`, not the text outside its calls), and its calls are its call
blocks', whatever the tool choice: the models write them natively, unconstrained (vLLM's
parsers take ``tool_choice`` ``required`` or a named function as ``auto``, and have no
grammar for ``strict``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from . import inkling, muse_glimmer
from .reasoning import Reasoning
from .tagged_args import TypedArgs, Types

Call = tuple[int, int, str, dict[str, Any], None]
"""A call read whole: where it lies, its function, its arguments, no id."""


@dataclass(frozen=True, slots=True)
class Format:
    """One format's readers (``thinking``: where the text begins, ``opens``'s)."""

    name: str
    tokens: tuple[str, ...]
    """Its markers, kept in the texts it reads."""
    reasoning: Callable[[str, bool | None, bool], str | None]
    content: Callable[[str, bool | None, bool], str]
    read_calls: Callable[[str, bool, Types], list[Call]]
    """The calls complete in a text (``True``: whole), given the request's functions'
    types."""
    opening: Callable[[str, int], tuple[int, str, None, int] | None]
    """The call being written after an offset, once its arguments are begun (for
    streaming them; None: none, or calls come whole)."""
    call_start: Callable[[str], int]
    """Where a call may begin in a text so far."""
    opens: Callable[[str], bool | None]
    """Where a text begins, given its prompt's end."""
    answer_tag: str = ""
    """The marker an answer follows (where a response's constraint begins; "": none)."""
    typed_args: TypedArgs | None = None
    """How the call being written reads where its function's schema types its values
    (streamed as settled; None: its arguments as written)."""


FORMATS: Final = {
    "inkling": Format(
        "inkling", inkling.TOKENS, inkling.reasoning, inkling.content,
        inkling.calls,
        inkling.opening, inkling.call_start, inkling.opens, inkling.TEXT, inkling.settled,
    ),
    "muse_glimmer": Format(
        "muse_glimmer", muse_glimmer.TOKENS,
        lambda text, thinking, final: muse_glimmer.reasoning(text, final),
        lambda text, thinking, final: muse_glimmer.content(text, final),
        muse_glimmer.calls, lambda text, start: None, muse_glimmer.call_start,
        lambda prompt_end: None,
    ),
}  # fmt: skip
"""The formats, by their parsers' names (vLLM's, for both its reasoning and tool
parsers)."""


class BlocksReasoning(Reasoning):
    """A block format's split: the reasoning is its reasoning blocks', wherever they are
    (:attr:`interleaved`); the answer is the whole text, read by the format (its tool
    parser alone streams the same reasoning, as vLLM's)."""

    __slots__ = ("format",)

    interleaved: ClassVar[bool] = True

    def __init__(self, parser: str) -> None:
        super().__init__(parser)  # no tags
        self.format = FORMATS[parser]

    @property
    def tags(self) -> tuple[str, ...]:
        return self.format.tokens

    @property
    def answer_marker(self) -> tuple[str, str, str]:
        return self.format.answer_tag, "", ""

    def opens(self, prompt_end: str) -> bool | None:
        return self.format.opens(prompt_end)

    def answer_start(self, text: str, final: bool, thinking: bool | None) -> int | None:
        return 0

    def split(self, text: str, thinking: bool | None) -> tuple[str | None, str]:
        return self.format.reasoning(text, thinking, True), text

    def so_far(self, text: str, thinking: bool | None) -> str:
        return self.format.reasoning(text, thinking, False) or ""
