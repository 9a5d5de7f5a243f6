"""A reasoning model's text split into its reasoning and its answer (vLLM's reasoning
parsers, chosen by the model's ``reasoning_parser`` option).

Each parser names the tags around the reasoning (:data:`TAGS`): ``<think>`` and
``</think>`` for ``deepseek_r1``, ``qwen3``, ``glm45`` and ``deepseek_v3``, ``[THINK]``
and ``[/THINK]`` for ``mistral`` (Magistral), ``<seed:think>`` and ``</seed:think>`` for
``seed_oss``, and the plain-text ``Here is my thought process:`` and ``Here is my
response:`` for ``granite`` (Granite 3.2 with ``thinking`` on; ``Here's`` for ``Here is``
too, as quantized Granites write it, vLLM's :data:`SPELLINGS`). ``openai_gptoss`` reads gpt-oss's harmony messages instead
(:class:`HarmonyReasoning`, :mod:`.harmony`): no tags, but channels.

Whether a text begins in its reasoning (``thinking``) is read off the prompt's end
(:meth:`Reasoning.opens`): a prompt that leaves the opening tag open (DeepSeek-R1's
template, Qwen3's thinking models, DeepSeek-V3.1 with ``thinking`` on) begins it; one that
closes it (Qwen3 with ``enable_thinking`` false, GLM-4.5 with thinking off, DeepSeek-V3.1
by default) does not. Otherwise ``deepseek_r1`` takes the text to begin in its reasoning
(a leading opening tag left out), and the other parsers only where it begins with the
opening tag; else it is all answer.

A text that begins in its reasoning is reasoning up to its first closing tag, and all
reasoning without one (cut while thinking). The answer is where tool calls are read, so a
call the model only thought about is not made; until the closing tag comes, none is read.
A request's constraint begins after the closing tag (``Sampling.constraint_after``), or
from the first token where the prompt closed the reasoning; gpt-oss's, in its final
message (:attr:`Reasoning.answer_marker`).

Streamed, each delta carries the reasoning and the answer it adds
(:meth:`Reasoning.so_far`): held back are a possible tag being written, and trailing
whitespace, so that the deltas' pieces add up to the result's ``reasoning_content``.
"""

from __future__ import annotations

from typing import ClassVar, Final

from . import harmony

TAGS: Final[dict[str, tuple[str, str]]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "deepseek_v3": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "granite": ("Here is my thought process:", "Here is my response:"),
}
"""Each parser's opening and closing tags."""
SPELLINGS: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "granite": (("Here's my thought process:",), ("Here's my response:",)),
}
"""Other spellings of a parser's opening and closing tags, read as they are."""
REASONING_PARSERS: Final = (*TAGS, "openai_gptoss")
"""The values of a model's ``reasoning_parser`` option."""
_BEGINS: Final = ("deepseek_r1",)
"""The parsers whose texts begin in their reasoning unless the prompt closed it."""


class Reasoning:
    """One parser's split (see the module docstring)."""

    __slots__ = ("close", "closings", "open", "openings", "parser")

    interleaved: ClassVar[bool] = False
    """Reasoning may follow the answer's start (its parts so far are still asked for)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.open, self.close = TAGS[parser]
        more_open, more_close = SPELLINGS.get(parser, ((), ()))
        self.openings = (self.open, *more_open)
        self.closings = (self.close, *more_close)

    @property
    def tags(self) -> tuple[str, ...]:
        return *self.openings, *self.closings

    @property
    def answer_marker(self) -> tuple[str, str, str]:
        """Where a constraint may begin: after a tag, a word and a second tag (the word and
        second tag may be empty): here, the closing tag."""
        return self.close, "", ""

    def opens(self, prompt_end: str) -> bool | None:
        """Whether the text after a prompt ending ``prompt_end`` begins in its reasoning
        (None: the text's own start tells)."""
        tail = prompt_end.rstrip()
        if tail.endswith(self.openings):
            return True
        if tail.endswith(self.closings):
            return False
        return True if self.parser in _BEGINS else None

    def answer_start(self, text: str, final: bool, thinking: bool | None) -> int | None:
        """Where the answer begins in ``text`` (a text so far; ``final``: all of it); None
        while that is not known yet (it may still be reasoning)."""
        if thinking is None:  # the text's start tells
            head = text.lstrip()
            if not head.startswith(self.openings):
                return None if not final and _begins(self.openings, head) else 0
        elif not thinking:
            return 0
        end, tag = _first(text, self.closings)
        if end >= 0:
            return end + len(tag)
        return len(text) if final else None

    def split(self, text: str, thinking: bool | None) -> tuple[str | None, str]:
        """A whole text's reasoning (None: none) and its answer."""
        start = self.answer_start(text, True, thinking)
        assert start is not None
        if start == 0:
            return None, text
        return self._clean(text[:start]), text[start:]

    def so_far(self, text: str, thinking: bool | None) -> str:
        """The reasoning a text so far shows for certain: the start of the whole text's
        reasoning (:meth:`split`), whatever follows."""
        start = self.answer_start(text, False, thinking)
        if start == 0:
            return ""
        if start is not None:
            return self._clean(text[:start])
        if thinking is None and not text.lstrip().startswith(self.openings):
            return ""  # not known yet to be reasoning
        body = text[: len(text) - max(held(text, c) for c in self.closings)]
        head = body.lstrip()
        if not head.startswith(self.openings) and _begins(self.openings, head):
            return ""  # perhaps the opening tag being written
        return self._clean(body)

    def _clean(self, reasoning: str) -> str:
        for close in self.closings:
            if reasoning.endswith(close):
                reasoning = reasoning[: -len(close)]
                break
        head = reasoning.lstrip()
        for open_ in self.openings:
            if head.startswith(open_):
                reasoning = head[len(open_) :]
                break
        return reasoning.strip()

    def content(self, answer: str) -> str:
        """An answer's (so far) content (OpenAI's message ``content``), trimmed."""
        return answer.strip()


class HarmonyReasoning(Reasoning):
    """gpt-oss's split (``openai_gptoss``): the reasoning is the ``analysis`` messages,
    those after the answer's start too (:attr:`interleaved`); the answer begins at the
    first other message, and its content is its final messages and preambles
    (:mod:`.harmony`). Where the text begins is the text's own business, so the prompt's
    end tells nothing. A constraint begins in the final message, after its header
    (:attr:`answer_marker`)."""

    interleaved: ClassVar[bool] = True

    def __init__(self, parser: str = "openai_gptoss") -> None:
        self.parser = parser
        self.open = self.close = ""
        self.openings = self.closings = ()

    @property
    def tags(self) -> tuple[str, ...]:
        return harmony.TOKENS

    def opens(self, prompt_end: str) -> bool | None:
        return None

    @property
    def answer_marker(self) -> tuple[str, str, str]:
        """The final message's header, ``<|channel|>final`` … ``<|message|>``."""
        return harmony.CHANNEL, "final", harmony.MESSAGE

    def answer_start(self, text: str, final: bool, thinking: bool | None) -> int | None:
        return harmony.answer_start(text, final)

    def split(self, text: str, thinking: bool | None) -> tuple[str | None, str]:
        start = harmony.answer_start(text, True)
        assert start is not None
        return harmony.reasoning(text), text[start:]

    def so_far(self, text: str, thinking: bool | None) -> str:
        return harmony.reasoning(text) or ""

    def content(self, answer: str) -> str:
        return harmony.content(answer)


def reasoning_for(parser: str) -> Reasoning:
    """The split a ``reasoning_parser`` names."""
    return HarmonyReasoning(parser) if parser == "openai_gptoss" else Reasoning(parser)


def _begins(tags: tuple[str, ...], head: str) -> bool:
    """Whether ``head`` may be one of ``tags`` being written."""
    return any(t.startswith(head) for t in tags)


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of ``tags`` in ``text`` is, and which (-1: none)."""
    best, found = -1, ""
    for t in tags:
        j = text.find(t)
        if j >= 0 and (best < 0 or j < best):
            best, found = j, t
    return best, found


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker`` (the longest end
    that is a proper prefix of it; 0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
