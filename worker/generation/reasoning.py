"""A reasoning model's text split into its reasoning and its answer (vLLM's reasoning
parsers, chosen by the model's ``reasoning_parser`` option).

Each parser names the tags around the reasoning (:data:`TAGS`): ``<think>`` and
``</think>`` for most (``deepseek_r1``, ``qwen3``, ``glm45``, ``glm47``, ``deepseek_v3``,
``deepseek_v4``, ``ernie45``, ``holo2``, ``hunyuan_a13b``, ``hy_v3``, ``kimi_k2``,
``mimo``, ``minimax_m2``, ``nemotron_v3``, ``olmo3``, ``poolside_v1``, ``step3p5``,
``ling3``; and
``hy_v4``, whose tags end in the suffix its checkpoint's vocabulary tells, e.g.
``<think:6124c78e>``, :data:`SUFFIXES`), ``</think>`` alone for ``step3`` and
``<|think:end|>`` alone for ``solar_open2`` (no opening tag: one they write is reasoning
too), ``<mm:think>`` and ``</mm:think>`` for ``minimax_m3`` (a stray closing tag at the
very start of an answer left out, :data:`_STRAYS`), Kimi-K3's XTML channels
``<|open|>think<|sep|>`` and ``<|close|>think<|sep|>`` for ``kimi_k3`` (each three
tokens, the special ones kept in the text, :data:`PIECES`), ``[THINK]`` and ``[/THINK]``
for ``mistral`` (Magistral),
``<seed:think>`` and ``</seed:think>`` for ``seed_oss``, ``<|channel>`` and
``<channel|>`` for ``gemma4`` (its reasoning's leading ``thought`` label left out,
:data:`LABELS`), and the plain-text ``Here is my thought process:`` and ``Here is my
response:`` for ``granite`` (Granite 3.2 with ``thinking`` on; ``Here's`` for ``Here is``
too, as quantized Granites write it, vLLM's :data:`SPELLINGS`). ``kimi_k2``'s tool
section, ``deepseek_v4``'s DSML tool calls, ``solar_open2``'s ``<|tool_call:start|>`` and
``ling3``'s and ``glm47``'s ``<tool_call>`` (GLM-4.7's calls, vLLM's ``glm47`` parser's
end of reasoning) end the reasoning too, and begin the answer (:data:`ENDS`). ``hunyuan_a13b`` wraps its
answer in ``<answer>`` … ``</answer>``, ``ernie45`` in ``<response>`` … ``</response>``,
``kimi_k3`` in its response channel (or they write it bare): the content is what they
wrap (:data:`WRAPS`, :meth:`Reasoning.answer`); ``kimi_k3``'s tools channel after it is
read on, for its calls (:data:`SIBLINGS`). ``identity`` and
``minimax_m2_append_think`` never split (:class:`WholeAnswer`): the whole text is the
answer, the latter's content begun with the ``<think>`` its prompt opened.
``openai_gptoss`` reads gpt-oss's harmony messages instead (:class:`HarmonyReasoning`,
:mod:`.harmony`): no tags, but channels; ``cohere_command3`` and ``cohere_command4`` read
Cohere Command's modes (:class:`CohereReasoning`, :mod:`.cohere`); ``inkling`` and
``muse_glimmer`` their message blocks (:class:`.blocks.BlocksReasoning`).

Whether a text begins in its reasoning (``thinking``) is read off the prompt's end
(:meth:`Reasoning.opens`): a prompt that leaves the opening tag open (DeepSeek-R1's
template, Qwen3's thinking models, DeepSeek-V3.1 with ``thinking`` on, Kimi-K2.5,
MiniMax-M2, GLM-4.7, MiniMax-M3 with ``thinking_mode`` enabled, Solar-Open2 at a medium or
higher effort) begins it; one that closes it (Qwen3 with ``enable_thinking`` false,
GLM-4.5 with thinking off, DeepSeek-V3.1 by default, Solar-Open2 at a low effort) does
not. Otherwise ``deepseek_r1``, ``ernie45``, ``glm47``, ``holo2``, ``hy_v4``, ``kimi_k2``,
``kimi_k3``, ``ling3``, ``minimax_m2``, ``nemotron_v3``, ``olmo3``, ``solar_open2``,
``step3`` and ``step3p5`` take the text to begin in its reasoning, as vLLM's
do (their models' prompts open it, or the models may leave the opening tag out; a leading
one is left out), and the other parsers only where it begins with the opening tag; else
it is all answer.

A text that begins in its reasoning is reasoning up to its first closing tag (or marker
that ends it), and all reasoning without one (cut while thinking). The answer is where
tool calls are read, so a call the model only thought about is not made; until the
closing tag comes, none is read. A request's constraint begins after the closing tag
(``Sampling.constraint_after``), or from the first token where the prompt closed the
reasoning (``identity``'s always); gpt-oss's, in its final message
(:attr:`Reasoning.answer_marker`).

Streamed, each delta carries the reasoning and the answer it adds
(:meth:`Reasoning.so_far`, :meth:`Reasoning.answer`): held back are a possible tag (or
label) being written, and trailing whitespace, so that the deltas' pieces add up to the
result's ``reasoning_content`` and ``content``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar, Final

from . import cohere, harmony

TAGS: Final[dict[str, tuple[str, str]]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "deepseek_v3": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "granite": ("Here is my thought process:", "Here is my response:"),
    "deepseek_v4": ("<think>", "</think>"),
    "ernie45": ("<think>", "</think>"),
    "gemma4": ("<|channel>", "<channel|>"),
    "glm47": ("<think>", "</think>"),
    "holo2": ("<think>", "</think>"),
    "hunyuan_a13b": ("<think>", "</think>"),
    "hy_v3": ("<think>", "</think>"),
    "hy_v4": ("<think>", "</think>"),
    "kimi_k2": ("<think>", "</think>"),
    "kimi_k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    "mimo": ("<think>", "</think>"),
    "minimax_m2": ("<think>", "</think>"),
    "minimax_m2_append_think": ("<think>", "</think>"),
    "minimax_m3": ("<mm:think>", "</mm:think>"),
    "nemotron_v3": ("<think>", "</think>"),
    "olmo3": ("<think>", "</think>"),
    "poolside_v1": ("<think>", "</think>"),
    "solar_open2": ("", "<|think:end|>"),
    "step3": ("", "</think>"),
    "step3p5": ("<think>", "</think>"),
    "ling3": ("<think>", "</think>"),
}
"""Each parser's opening and closing tags (``""``: it has no opening tag)."""
SPELLINGS: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "granite": (("Here's my thought process:",), ("Here's my response:",)),
}
"""Other spellings of a parser's opening and closing tags, read as they are."""
ENDS: Final[dict[str, tuple[str, ...]]] = {
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"),
    "deepseek_v4": ("<\uff5cDSML\uff5ctool_calls>",),
    "solar_open2": ("<|tool_call:start|>",),
    "ling3": ("<tool_call>",),
    "glm47": ("<tool_call>",),
}
"""Markers that end a parser's reasoning as its closing tag does, but begin its answer
(its tool calls' section, so they are read)."""
WRAPS: Final[dict[str, tuple[str, str]]] = {
    "hunyuan_a13b": ("<answer>", "</answer>"),
    "ernie45": ("<response>", "</response>"),
    "kimi_k3": ("<|open|>response<|sep|>", "<|close|>response<|sep|>"),
}
"""The tags around a parser's answer, left out of its content: an answer that begins with
the first is read up to the second."""
SIBLINGS: Final[dict[str, tuple[str, str]]] = {
    "kimi_k3": ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
}
"""A channel that may follow a parser's wrapped answer (Kimi-K3's tool calls), read on
with it, to its close; a bare answer of these parsers (the prompt opened the wrapping
channel) is read up to the wrapping's close too."""
PIECES: Final[dict[str, tuple[str, ...]]] = {"kimi_k3": ("<|open|>", "<|close|>", "<|sep|>")}
"""The special tokens a parser's tags are written with, where a tag takes several (kept
in the text, as a tag that is one token is)."""
LABELS: Final[dict[str, str]] = {"gemma4": "thought\n"}
"""What a parser's reasoning begins with, left out of ``reasoning_content``."""
PREFIXES: Final[dict[str, str]] = {"identity": "", "minimax_m2_append_think": "<think>"}
"""The parsers that never split (:class:`WholeAnswer`), and what their content begins
with."""
BLOCKS: Final = ("inkling", "muse_glimmer")
"""The message-block formats' parsers (:mod:`.blocks`)."""
REASONING_PARSERS: Final = (*TAGS, "identity", "openai_gptoss", *cohere.FORMATS, *BLOCKS)
"""The values of a model's ``reasoning_parser`` option."""
_BEGINS: Final = frozenset({"deepseek_r1", "ernie45", "glm47", "holo2", "hy_v4", "kimi_k2",
                            "kimi_k3", "minimax_m2", "nemotron_v3", "olmo3", "solar_open2",
                            "step3", "step3p5",
                            "ling3"})  # fmt: skip
"""The parsers whose texts begin in their reasoning unless the prompt closed it."""
SUFFIXES: Final[dict[str, re.Pattern[str]]] = {
    "hy_v4": re.compile(r"<(?:think|tool_calls|tool_call|arg_key|arg_value)(:[^\s>]+)?>"),
}
"""The parsers whose tags end in a suffix each checkpoint's vocabulary tells (HY-V4's
``<think:6124c78e>``): a pattern its structural tokens match whole, the suffix its first
group (vLLM's ``detect_token_suffix``)."""
_STRAYS: Final = frozenset({"minimax_m3"})
"""The parsers that leave out a closing tag at the very start of a text that does not
begin in its reasoning (MiniMax-M3 may begin its answer with a stray one)."""


class Reasoning:
    """One parser's split (see the module docstring)."""

    __slots__ = ("close", "closings", "enders", "label", "open", "openings", "parser", "stray",
                 "wrap")  # fmt: skip

    interleaved: ClassVar[bool] = False
    """Reasoning may follow the answer's start (its parts so far are still asked for)."""

    def __init__(self, parser: str, vocab: Iterable[str] | None = None) -> None:
        self.parser = parser
        self.open, self.close = TAGS.get(parser, ("", ""))
        if parser in SUFFIXES and vocab is not None:
            self.open, self.close = _suffixed(parser, (self.open, self.close), vocab)
        more_open, more_close = SPELLINGS.get(parser, ((), ()))
        self.openings = tuple(t for t in (self.open, *more_open) if t)
        self.closings = tuple(t for t in (self.close, *more_close) if t)
        self.enders = ENDS.get(parser, ())
        self.wrap = WRAPS.get(parser)
        self.label = LABELS.get(parser, "")
        self.stray = parser in _STRAYS

    @property
    def tags(self) -> tuple[str, ...]:
        """The markers its split reads (kept in the text where they are special tokens),
        and the special tokens they are written with (:data:`PIECES`)."""
        marks = *self.openings, *self.closings, *self.enders, *(self.wrap or ())
        return *marks, *PIECES.get(self.parser, ())

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
        if self.stray and thinking is not True:  # a stray closing tag is left out
            if text.startswith(self.close):
                return len(self.close)
            if not final and self.close.startswith(text):
                return None
        if thinking is None:  # the text's start tells
            head = text.lstrip()
            if not head.startswith(self.openings):
                return None if not final and _begins(self.openings, head) else 0
        elif not thinking:
            return 0
        end, tag = _first(text, self.closings + self.enders)
        if end >= 0:
            return end + (0 if tag in self.enders else len(tag))
        return len(text) if final else None

    def split(self, text: str, thinking: bool | None) -> tuple[str | None, str]:
        """A whole text's reasoning (None: none) and its answer (:meth:`answer`)."""
        start = self.answer_start(text, True, thinking)
        assert start is not None
        if start == 0 or self._strayed(text, thinking):
            return None, self.answer(text[start:])
        return self._clean(text[:start]), self.answer(text[start:])

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
        body = text[: len(text) - max(held(text, c) for c in self.closings + self.enders)]
        head = body.lstrip()
        if not head.startswith(self.openings) and _begins(self.openings, head):
            return ""  # perhaps the opening tag being written
        return self._clean(body)

    def answer(self, rest: str) -> str:
        """The answer where its content and calls are read, given ``rest``, the text (so
        far) from its start: all of it, or what its :data:`WRAPS` tags wrap (a tag maybe
        being written held back, so that it only grows with ``rest``)."""
        if self.wrap is None:
            return rest
        open_, close = self.wrap
        head = rest.lstrip()
        sibling = SIBLINGS.get(self.parser)
        if head.startswith(open_):
            body = head[len(open_) :]
        elif _begins((open_,), head):
            return ""
        elif sibling is None:
            return rest
        else:
            body = rest
        end = body.find(close)
        if end < 0:
            return body[: len(body) - held(body, close)]
        after = body.find(sibling[0], end) if sibling else -1
        if sibling is None or after < 0:
            return body[:end]
        stop = body.find(sibling[1], after)
        return body[:end] + body[after : len(body) if stop < 0 else stop + len(sibling[1])]

    def _strayed(self, text: str, thinking: bool | None) -> bool:
        """Whether ``text`` begins with a stray closing tag, left out (:data:`_STRAYS`)."""
        return self.stray and thinking is not True and text.startswith(self.close)

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
        if self.label.startswith(reasoning):
            return ""  # perhaps the label being written
        return reasoning.removeprefix(self.label).strip()

    def content(self, answer: str) -> str:
        """An answer's (so far) content (OpenAI's message ``content``), trimmed."""
        return answer.strip()


class WholeAnswer(Reasoning):
    """A parser that never splits (:data:`PREFIXES`): vLLM's ``identity``, and
    ``minimax_m2_append_think``, whose content begins with the ``<think>`` its prompt
    opened, then the whole text, ``</think>`` and all. Its text is all answer, where its
    calls are read; a constraint begins after its closing tag, where it has one (else
    from the first token: the prompt's end tells that the reasoning is over)."""

    __slots__ = ("prefix",)

    def __init__(self, parser: str) -> None:
        super().__init__(parser)
        self.prefix = PREFIXES[parser]

    def opens(self, prompt_end: str) -> bool | None:
        return super().opens(prompt_end) if self.closings else False

    def answer_start(self, text: str, final: bool, thinking: bool | None) -> int | None:
        return 0

    def answer(self, rest: str) -> str:
        return self.prefix + rest


class HarmonyReasoning(Reasoning):
    """gpt-oss's split (``openai_gptoss``): the reasoning is the ``analysis`` messages,
    those after the answer's start too (:attr:`interleaved`); the answer begins at the
    first other message, and its content is its final messages and preambles
    (:mod:`.harmony`). Where the text begins is the text's own business, so the prompt's
    end tells nothing. A constraint begins in the final message, after its header
    (:attr:`answer_marker`)."""

    interleaved: ClassVar[bool] = True

    def __init__(self, parser: str = "openai_gptoss") -> None:
        super().__init__(parser)  # no tags

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


class CohereReasoning(Reasoning):
    """Cohere Command's split (``cohere_command3``, ``cohere_command4``): the reasoning is
    its reasoning parts, wherever they are (:attr:`interleaved`), and the answer is the
    whole text, read by the mode machine (:mod:`.cohere`; its content and calls are the
    answer's and calls' parts). The prompt's end tells the mode the text begins in (a
    prompt ending ``<|START_THINKING|>``: the reasoning; one ending with the answer's
    marker: the answer); else the format's own start. A constraint begins after the
    answer's marker (``<|START_RESPONSE|>``; Command 4's ``<|START_TEXT|>``), as vLLM's
    structural tag does."""

    __slots__ = ("format",)

    interleaved: ClassVar[bool] = True

    def __init__(self, parser: str) -> None:
        super().__init__(parser)  # no tags
        self.format = cohere.FORMATS[parser]

    @property
    def tags(self) -> tuple[str, ...]:
        return self.format.tokens

    @property
    def answer_marker(self) -> tuple[str, str, str]:
        return self.format.answer_tag, "", ""

    def opens(self, prompt_end: str) -> bool | None:
        tail = prompt_end.rstrip()
        if tail.endswith(cohere.START_THINKING):
            return True
        answers = [m for m, mode in self.format.modes.items() if mode == cohere.ANSWER]
        return False if tail.endswith(tuple(answers)) else None

    def answer_start(self, text: str, final: bool, thinking: bool | None) -> int | None:
        return 0

    def split(self, text: str, thinking: bool | None) -> tuple[str | None, str]:
        mode = cohere.begins(self.format, thinking)
        return cohere.reasoning(text, self.format, mode, True), text

    def so_far(self, text: str, thinking: bool | None) -> str:
        mode = cohere.begins(self.format, thinking)
        return cohere.reasoning(text, self.format, mode, False) or ""


def reasoning_for(parser: str, vocab: Iterable[str] | None = None) -> Reasoning:
    """The split a ``reasoning_parser`` names, for a tokenizer whose tokens are ``vocab``
    (None: its tags as :data:`TAGS` writes them)."""
    if parser == "openai_gptoss":
        return HarmonyReasoning(parser)
    if parser in cohere.FORMATS:
        return CohereReasoning(parser)
    if parser in BLOCKS:
        from .blocks import BlocksReasoning  # it reads texts with this module's helpers

        return BlocksReasoning(parser)
    return WholeAnswer(parser) if parser in PREFIXES else Reasoning(parser, vocab)


def _suffixed(parser: str, tags: tuple[str, str], vocab: Iterable[str]) -> tuple[str, str]:
    """A :data:`SUFFIXES` parser's tags with the suffix ``vocab``'s structural tokens end
    in; a vocabulary without them is refused."""
    tokens = list(vocab)
    suffix = suffix_of(parser, tokens)
    open_, close = (t[:-1] + suffix + t[-1] for t in tags)
    if not {open_, close} <= set(tokens):
        raise ValueError(f"reasoning_parser {parser!r}: the tokenizer has no {open_} and "
                         f"{close} tokens")  # fmt: skip
    return open_, close


def suffix_of(parser: str, tokens: Iterable[str]) -> str:
    """The suffix a :data:`SUFFIXES` parser's structural tokens end in, in ``tokens``
    (the first such token's; "": none, or unsuffixed)."""
    pattern = SUFFIXES[parser]
    return next((m.group(1) or "" for t in tokens if (m := pattern.fullmatch(t))), "")


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
