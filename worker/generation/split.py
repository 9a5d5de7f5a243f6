"""One output's text split as it grows: its reasoning, its answer's content, and its tool
calls (a chat to a model with a ``reasoning_parser``, or a request with ``tools``).

Streamed, each delta carries the pieces of ``reasoning_content`` and ``content`` not sent
yet (each so far a start of the result's, so the pieces add up to it; but ``minicpm5``'s
stream keeps the thinking its result leaves out, as vLLM's, :attr:`OutputSplit.streamed`),
the calls read whole since the last delta, and the chunks of the calls being written
(:mod:`.tool_chunks`); at the end the whole text is read once more for the result
(:meth:`OutputSplit.result`). The answer begins after the reasoning (where
:class:`~.reasoning.Reasoning` says, once it knows; less the tags some parsers wrap it
in, :meth:`~.reasoning.Reasoning.answer`); calls are read in the answer only.
gpt-oss's reasoning may follow the answer's start (``Reasoning.interleaved``), and its
content is its harmony messages' (:mod:`.harmony`); Cohere Command's text is all answer,
read by its modes (:mod:`.cohere`): its content is its answer's parts, its reasoning its
reasoning's, wherever they are; a message-block format's (:mod:`.blocks`) likewise.
Kimi-K3's XTML channels, read by its tool parser alone, are unwrapped by it
(:func:`.xtml.answer`) where its reasoning parser would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import cohere, harmony, xtml
from .blocks import Format
from .reasoning import Reasoning
from .tool_chunks import CallChunks
from .tools import CallReader


@dataclass(slots=True)
class OutputSplit:
    """One output's split (its owner: the runner's sequence)."""

    reasoning: Reasoning | None
    """The model's reasoning parser, where this output is split by it (None: the text is
    all answer)."""
    thinking: bool | None
    """Whether its text begins in its reasoning (``GenSpec.thinking``)."""
    harmony: bool
    """The model writes harmony messages: an answer's content is theirs."""
    calls: CallReader | None = None
    """Its tool calls, read as its text comes (a request with ``tools``)."""
    chunks: CallChunks | None = None
    """...and streamed as they are written (a streaming request with ``tools``)."""
    answer_at: int | None = None
    """Where its answer begins in its text (None: not known yet)."""
    said: list[int] = field(default_factory=lambda: [0, 0])
    """The characters of its ``reasoning_content`` and ``content`` streamed so far."""
    answer: dict[str, Any] | None = None
    """Its result's fields, once read at its end."""
    streamed: str | None = None
    """The ``content`` its stream ends with, where it is not the result's: the thinking
    ``minicpm5``'s whole read leaves out stays in its stream, as in vLLM's."""
    cohere: cohere.Format | None = None
    """The model writes Cohere Command's modes: an answer's content is its answer's
    parts (the calls' parts are not), whatever its calls."""
    blocks: Format | None = None
    """The model writes message blocks (:mod:`.blocks`): an answer's content is its
    format's, whatever its calls."""
    channels: bool = False
    """The model writes Kimi-K3's XTML channels and no reasoning parser unwraps them
    (:func:`.xtml.answer`): an answer's content is its response channel's, its calls are
    its tools channel's."""

    def __post_init__(self) -> None:
        if self.reasoning is None:
            self.answer_at = 0

    def result(self, text: str) -> dict[str, Any]:
        """The whole text's ``reasoning_content`` (where it has one), ``content`` (its
        answer outside its tool calls, trimmed) and ``tool_calls`` (where it made some),
        read once."""
        if self.answer is None:
            out: dict[str, Any] = {}
            answer = xtml.answer(text) if self.channels and self.reasoning is None else text
            if self.reasoning is not None:
                reasoning, answer = self.reasoning.split(text, self.thinking)
                if reasoning is not None:
                    out["reasoning_content"] = reasoning
            if self.calls is not None:
                answer = self.calls.clean(answer, True)
            out["content"] = self.content(answer, final=True)
            if (reader := self.calls) is not None:
                reader.read(answer, final=True)
                if reader.calls:
                    out["tool_calls"] = reader.calls
                    if self.cohere is None and self.blocks is None:
                        out["content"] = reader.content
                if reader.streams_thinking:
                    self.streamed = reader.outside if reader.calls else answer.strip()
            self.answer = out
        return self.answer

    def content(self, answer: str, final: bool = False) -> str:
        """An answer's (so far; ``final``: whole) content, trimmed: all of it, a harmony
        answer's final messages and preambles, or a Command answer's answer parts."""
        if self.cohere is not None:
            mode = cohere.begins(self.cohere, self.thinking)
            return cohere.content(answer, self.cohere, mode, final)
        if self.blocks is not None:
            return self.blocks.content(answer, self.thinking, final)
        if self.channels and self.reasoning is None:  # the tools channel's text is not
            return answer.split(xtml.TOOLS[0], 1)[0].strip()
        if self.harmony:
            return harmony.content(answer)
        return answer.strip() if self.calls is None else self.calls.shown(answer.strip(), final)

    def delta(self, released: str, new: str, final: str | None) -> dict[str, Any]:
        """A delta's fields, given the text released so far and ``new``, the part just
        released (``final``: the whole text, at the end): the pieces of its ``content``
        and ``reasoning_content`` not streamed yet, its ``tool_calls`` read since the last
        delta, and its ``tool_call_chunks`` (where there are some)."""
        chunks: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        if final is not None:
            got = self.result(final)
            content = got["content"] if self.streamed is None else self.streamed
            said = (got.get("reasoning_content", ""), content)
            if self.chunks is not None:  # the calls a final read found (ids set before)
                chunks = self.chunks.chunks("", final=True)
            calls = self.calls.unsent() if self.calls is not None else []
        elif new:
            reasoning, content, calls, chunks = self._so_far(released, new)
            said = (reasoning, content)
        else:
            said = ("", "")
        pieces = [whole[had:] for whole, had in zip(said, self.said, strict=True)]
        self.said[0] += len(pieces[0])
        self.said[1] += len(pieces[1])
        parts: dict[str, Any] = {"content": pieces[1]}
        if self.reasoning is not None:
            parts["reasoning_content"] = pieces[0]
        if calls:
            parts["tool_calls"] = calls
        if chunks:
            parts["tool_call_chunks"] = chunks
        return parts

    def _so_far(
        self, released: str, new: str
    ) -> tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]:
        """The reasoning and content so far (each a start of the result's), the calls
        read since last asked, and their chunks since then."""
        reasoning = ""
        split = self.reasoning
        if self.answer_at is None:  # the answer follows the reasoning
            assert split is not None
            self.answer_at = split.answer_start(released, False, self.thinking)
            reasoning = split.so_far(released, self.thinking)
        elif split is not None and split.interleaved:
            reasoning = split.so_far(released, self.thinking)  # gpt-oss thinks again
        if self.answer_at is None:
            return reasoning, "", [], []
        answer = released[self.answer_at :]
        if split is not None:
            answer = split.answer(answer)
        elif self.channels:
            answer = xtml.answer(answer)
        reader = self.calls
        if reader is None:
            return reasoning, self.content(answer), [], []
        answer = reader.clean(answer, False)
        if reader.may_complete(new):
            reader.read(answer)
        chunks = [] if self.chunks is None else self.chunks.chunks(answer)  # before ids go
        own = self.cohere is not None or self.blocks is not None
        content = self.content(answer) if own else reader.content_so_far(answer)
        return reasoning, content, reader.unsent(), chunks
