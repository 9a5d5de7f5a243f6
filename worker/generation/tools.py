"""Tool calls read out of a generated text (schemas/tools.py has the request side).

With ``tool_choice`` ``required`` or a named function the text was constrained to JSON
(vLLM's schemas), so it parses unless generation stopped early (``length``, a deadline).
With ``auto`` the text is free, and a parser for the model's own format (its
``tool_call_parser`` option; vLLM's names, :mod:`.tool_formats` lists them) finds the
calls: in blocks between markers (:mod:`.tool_blocks`), or in the whole text
(:mod:`.tool_scans`; :mod:`.blocks`'s message blocks).

:class:`CallReader` reads an output's text as it grows: a call counts once its text is
complete (a closed block, a closed JSON object, a closed list), so the calls read from a
prefix of the text are the first of those read from the whole, and each is streamed once,
with the id the result gives it.

Streamed, the text outside the calls goes out as ``content`` (:meth:`CallReader.content_so_far`):
the text before where the first call may begin (its marker or opening bracket, or what may
be their start), then, at the end, what follows the last call; so the deltas' pieces add
up to the result's ``content``, and no call's markup is streamed as content.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from ...schemas.tools import ToolUse
from . import blocks, cohere, harmony, minicpm5_text
from .json_compact import compact
from .reasoning import held
from .tagged_args import Types
from .tool_blocks import BLOCKS, SECTIONED, scan_blocks, sectioned, with_dots_json
from .tool_formats import ALIASES, LATER, MARKERS, PARSERS, SECTIONS, TYPED
from .tool_found import Found, Resume, Scan, skip
from .tool_scans import SCANNERS, named, no_calls, openai_calls, required

__all__ = ["ALIASES", "MARKERS", "PARSERS", "TYPED", "CallReader", "new_id", "read_calls"]

assert set(SCANNERS) | set(BLOCKS) | set(ALIASES) | set(blocks.FORMATS) | LATER == set(PARSERS)


class CallReader:
    """One output's tool calls, read as its text grows (see the module docstring)."""

    __slots__ = ("_at", "_harmony", "_hold", "_scan", "_section", "_settled", "_tidy",
                 "calls", "content", "end", "limit", "outside", "sent")  # fmt: skip

    def __init__(self, use: ToolUse, parser: str | None, types: Types | None = None) -> None:
        parser = ALIASES.get(parser or "", parser)
        self._tidy = parser == "minicpm5" and use.kind == "auto"
        """Its text is cleaned up, and its content shown, as vLLM's tool parser does
        (:mod:`.minicpm5_text`)."""
        self._scan = _scanner(use, parser, types or {})
        self._hold = _holder(use, parser)
        self._section = SECTIONS.get(parser or "") if use.kind == "auto" else None
        self._harmony = parser == "openai"
        """The text is harmony messages (whatever the tool choice): its content is
        theirs, not the text outside the calls."""
        self.limit = None if use.parallel else 1
        """How many calls count (None: all; ``parallel_tool_calls`` false: the first)."""
        self._at = 0
        self._settled: list[Found] = []
        """The calls before ``_at``, where the text read last was settled."""
        self.calls: list[dict[str, Any]] = []
        """Read so far, in order, as a result's ``tool_calls``."""
        self.sent = 0
        """How many of them were streamed."""
        self.content: str | None = None
        """After a final read that found calls: the text outside them (OpenAI's message
        ``content``), trimmed."""
        self.outside: str | None = None
        """...and that text as it is (``content`` less what :meth:`shown` leaves out)."""
        self.end = 0
        """Where the last call read ends in the text (0: none read)."""

    def read(self, text: str, final: bool = False) -> None:
        """Take the output's text so far (``final``: all of it); each text given is the
        one before and more."""
        new, settled = self._scan(text, final, self._at)
        found = self._settled + new
        if settled > self._at:
            self._settled += [f for f in new if f.end <= settled]
            self._at = settled
        for f in found[len(self.calls) : self.limit]:
            self.calls.append(_call(f.name, f.args, f.id))
            self.end = f.end
        if final and self.calls:
            start, end = found[0].start, found[-1].end
            if self._section is not None:  # the section's markers are the calls' too
                begin, close = self._section
                at = text.rfind(begin, 0, start)
                if at >= 0 and not text[at + len(begin) : start].strip():
                    start = at
                if text.startswith(close, skip(text, end)):
                    end = skip(text, end) + len(close)
            self.outside = (text[:start] + text[end:]).strip()
            self.content = (
                harmony.content(text) if self._harmony else self.shown(self.outside, True)
            )

    def content_so_far(self, text: str) -> str:
        """The content a text so far shows for certain (a start of the whole text's
        ``content``): its text before where a call may begin, trimmed (harmony: its
        final messages' and preambles')."""
        if self._harmony:
            return harmony.content(text)
        return self.shown(text[: self._hold(text)].strip(), False)

    def clean(self, text: str, final: bool) -> str:
        """The text (so far; ``final``: whole) its parser reads: as written, or cleaned
        up (:func:`.minicpm5_text.clean`)."""
        return minicpm5_text.clean(text, final) if self._tidy else text

    def shown(self, text: str, final: bool) -> str:
        """The content a trimmed text outside the calls (so far) shows: all of it, or
        the whole text's less its thinking (:func:`.minicpm5_text.shown`)."""
        return minicpm5_text.shown(text, final) if self._tidy else text

    @property
    def streams_thinking(self) -> bool:
        """Whether a stream's content keeps the thinking the whole text's leaves out
        (``minicpm5``'s, as vLLM's stream keeps it)."""
        return self._tidy

    def may_call(self, text: str) -> bool:
        """Whether a call may have begun in a text so far."""
        return self._hold(text) < len(text)

    @staticmethod
    def may_complete(new: str) -> bool:
        """Whether text ``new`` (just released) may complete a call: a call's text ends
        with one of ``>}]``, so text without them is not worth reading again."""
        return ">" in new or "}" in new or "]" in new

    def unsent(self) -> list[dict[str, Any]]:
        """The calls read since this was last asked."""
        out = self.calls[self.sent :]
        self.sent = len(self.calls)
        return out


def read_calls(use: ToolUse, text: str, parser: str | None,
               types: Types | None = None) -> list[dict[str, Any]] | None:  # fmt: skip
    """The calls a whole ``text`` makes, as a result's ``tool_calls`` (None: none)."""
    reader = CallReader(use, parser, types)
    reader.read(reader.clean(text, True), final=True)
    return reader.calls or None


def _scanner(use: ToolUse, parser: str | None, types: Types) -> Resume:
    if parser == "openai":  # harmony calls, whatever the tool choice (harmony.calls_grammar)
        return _whole(openai_calls)
    if parser in blocks.FORMATS:  # its call blocks, whatever the tool choice
        read = blocks.FORMATS[parser].read_calls
        return _whole(lambda text, final: [Found(*c) for c in read(text, final, types)])
    if use.kind == "named":
        assert use.name is not None
        return _whole(named(use.name))
    if use.kind == "required":
        return _whole(required)
    if parser in SECTIONED:
        return _whole(sectioned(parser or "", types))
    if parser in BLOCKS:
        opening, closing, body = BLOCKS[parser]
        scan = scan_blocks(opening, closing, body, types)
        return with_dots_json(scan, types) if parser == "dots" else scan
    return _whole(SCANNERS.get(parser or "", no_calls))


def _holder(use: ToolUse, parser: str | None) -> Callable[[str], int]:
    """Where, in a text so far, a call may begin: the text before is content whatever
    follows (see the module docstring)."""
    if parser == "openai":
        return harmony.call_start
    if parser in cohere.FORMATS:
        return _marked(cohere.START_ACTION)
    if parser in blocks.FORMATS:
        return blocks.FORMATS[parser].call_start
    if use.kind != "auto":  # the text is the calls
        return lambda text: 0
    if parser in SECTIONS:
        return _marked(SECTIONS[parser][0])
    if parser in BLOCKS:
        return _marked(BLOCKS[parser][0])
    if parser in ("mistral", "granite", "olmo3", "lfm2", "granite-20b-fc"):
        return _marked(MARKERS[parser][0])
    if parser == "gigachat3":  # (vLLM's content: the text before <|message_sep|> or the call)
        return _marked("<|message_sep|>", "function call<|role_sep|>", "<|function_call|>")
    if parser == "phi4_mini_json":
        return _before_array(("functools",))
    if parser == "xlam":
        lead = _leading("[", "[")
        fenced = _before_array(("```json", "```", "[TOOL_CALLS]", "<tool_call>"))
        return lambda text: min(lead(text), fenced(text))
    if parser == "llama3_json":
        return _leading("<|python_tag|>", "{")
    if parser == "pythonic":
        return _leading("<|python_start|>", "[")
    return len


def _marked(*markers: str) -> Callable[[str], int]:
    """Calls begin at the first of ``markers``."""

    def hold(text: str) -> int:
        found = [at for m in markers if (at := text.find(m)) >= 0]
        if found:
            return min(found)
        return len(text) - max(held(text, m) for m in markers)  # a start of one, perhaps

    return hold


def _before_array(markers: tuple[str, ...]) -> Callable[[str], int]:
    """Calls begin at a marker that a JSON array follows: the first one whose text so far
    may go on so (nothing but whitespace yet, or ``[``), or a marker's start at the end."""

    def hold(text: str) -> int:
        cut = len(text) - max(held(text, m) for m in markers)
        for m in markers:
            at = text.find(m)
            while 0 <= at < cut:
                i = skip(text, at + len(m))
                if i == len(text) or text[i] == "[":
                    cut = at
                    break
                at = text.find(m, at + 1)
        return cut

    return hold


def _leading(marker: str, bracket: str) -> Callable[[str], int]:
    """Calls are the whole text, which begins with ``marker`` or ``bracket``."""

    def hold(text: str) -> int:
        i = skip(text, 0)
        head = text[i : i + len(marker)]
        if head.startswith(bracket) or marker.startswith(head):
            return i  # calls, perhaps (or nothing yet)
        return len(text)

    return hold


def _whole(scan: Scan) -> Resume:
    """A scan that reads the whole text each time."""

    def resume(text: str, final: bool, start: int) -> tuple[list[Found], int]:
        return scan(text, final), 0

    return resume


def _call(name: str, args: dict[str, Any], cid: str | None = None) -> dict[str, Any]:
    return {"id": cid or new_id(), "type": "function",
            "function": {"name": name, "arguments": compact(args)}}  # fmt: skip


def new_id() -> str:
    """A call's id, where the model gives none (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"
