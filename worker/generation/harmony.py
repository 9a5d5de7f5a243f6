"""gpt-oss's text read as OpenAI's harmony messages (vLLM's ``openai_gptoss`` reasoning
parser and ``openai`` tool parser).

A gpt-oss model answers in messages, each a header, ``<|message|>``, its content, and an
end token: ``<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final
<|message|>…<|return|>``. The header names the message's channel (``analysis``: the
reasoning; ``final``: the answer; ``commentary``: tool calls, and preambles, text meant
for the user) and its recipient (``to=functions.NAME``: a call of a function, its content
the arguments as JSON, ending ``<|call|>``; the recipient may be written before or after
the channel). Here:

- the *reasoning* (``reasoning_content``) is the ``analysis`` messages (those to built-in
  tools too), each trimmed, joined by a newline, wherever they are: a model may think
  again after a preamble or a call's result (vLLM's ``parse_chat_output`` too);
- the *answer* begins at the first other message (a call, a final message, a preamble);
  the reasoning messages after it are not its content;
- its *content* is its ``final`` and ``commentary`` messages that call nothing, each
  trimmed, joined by a newline (the calls' arguments, and messages to built-in tools such
  as ``browser.search``, are not content);
- its *calls* (:func:`calls`) are its messages to ``functions.NAME`` whose content is a
  JSON object, once the message has ended (or the text has).

A text that does not begin with one of the format's tokens is no harmony (a model that
writes it does not): all of it is content. Every message boundary is a special token,
decoded whole, so a text so far never ends in a marker's start; what a text so far shows (:func:`reasoning`, :func:`content` with
``whole`` false) is always a start of what the whole text shows: a message being written
adds its content trimmed, and its newline only once it has a character to show.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
    "<|call|>",
)  # fmt: skip
TOKENS: Final = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
"""The format's special tokens: kept in the texts its parsers read."""
_ENDS: Final = (END, RETURN, CALL)
_CHANNEL: Final = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT: Final = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
FUNCTIONS: Final = "functions."


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a text (or the one being written, at its end)."""

    at: int
    """Where its header begins."""
    body: int | None
    """Where its content begins (None: its header is still being written)."""
    end: int
    """Where its content ends (the text's end while it is being written)."""
    after: int
    """Where the next message begins (after its end token)."""
    closed: bool
    """Its end token was written."""
    channel: str | None
    recipient: str | None

    @property
    def call(self) -> str | None:
        """The function it calls (None: none)."""
        r = self.recipient
        return r[len(FUNCTIONS) :] if r is not None and r.startswith(FUNCTIONS) else None

    @property
    def reasoning(self) -> bool:
        """Its content is reasoning (an ``analysis`` message that calls no function: one
        to a built-in tool, such as ``browser.search``, is the model's own business)."""
        return self.channel == "analysis" and self.call is None

    @property
    def shown(self) -> bool:
        """Its content is the answer's (a final message, or a preamble)."""
        return self.recipient is None and self.channel != "analysis"


def _plain(text: str) -> bool | None:
    """Whether ``text`` (so far) is no harmony (None: not known yet, its start may be a
    token's being written, where the tokens are not special)."""
    head = text.lstrip()
    if head.startswith(TOKENS):
        return False
    return None if any(t.startswith(head) for t in TOKENS) else True


def messages(text: str, start: int = 0) -> list[Message]:
    """The messages of ``text`` from ``start`` (a message's header start; none in a text
    that is no harmony)."""
    out: list[Message] = []
    if start == 0 and _plain(text) is not False:
        return out
    i, n = start, len(text)
    while i < n:
        m = text.find(MESSAGE, i)
        if m < 0:
            if text[i:].strip():
                out.append(Message(i, None, n, n, False, None, None))
            break
        header = text[i:m]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        body = m + len(MESSAGE)
        end, token = _end(text, body)
        out.append(Message(i, body, end, end + len(token) if token else n, bool(token),
                           channel.group(1) if channel else None,
                           recipient.group(1) if recipient else None))  # fmt: skip
        if not token:
            break
        i = end + len(token)
    return out


def _end(text: str, at: int) -> tuple[int, str]:
    """Where the content from ``at`` ends, and its end token ("": none yet; then before
    what may be one's start, where the tokens are not special)."""
    best, token = len(text), ""
    for t in _ENDS:
        j = text.find(t, at, best)
        if j >= 0:
            best, token = j, t
    if not token:
        tail = text[at:]
        best -= max((n for t in _ENDS for n in range(1, len(t)) if tail.endswith(t[:n])),
                    default=0)  # fmt: skip
    return best, token


def answer_start(text: str, final: bool) -> int | None:
    """Where the answer begins (its first message that is not reasoning); ``final``: the
    text is whole (all reasoning: its end); None: not known yet."""
    plain = _plain(text)
    if plain is not False:
        return 0 if plain or final else None
    for m in messages(text):
        if m.body is None:
            return m.at if final else None
        if not m.reasoning:
            return m.at
    return len(text) if final else None


def reasoning(text: str) -> str | None:
    """The reasoning a text (so far) shows: all its analysis messages (None: it has
    none)."""
    kept = [m for m in messages(text) if m.body is not None and m.reasoning]
    return None if not kept else _join(text, kept)


def content(text: str) -> str:
    """The content an answer's text (so far) shows."""
    plain = _plain(text)
    if plain is not False:
        return text.strip() if plain else ""
    return _join(text, (m for m in messages(text) if m.body is not None and m.shown))


def _join(text: str, ms: Iterable[Message]) -> str:
    parts = (text[m.body : m.end].strip() for m in ms if m.body is not None)
    return "\n".join(p for p in parts if p)


def call_start(text: str, start: int = 0) -> int:
    """Where, from ``start``, a call may begin: the first message that is one or whose
    header is still being written (the text's end: none)."""
    plain = _plain(text)
    if plain is not False:
        return len(text) if plain else 0
    for m in messages(text, start):
        if m.body is None or m.call is not None:
            return m.at
    return len(text)


def calls_grammar(functions: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """A Lark grammar (llguidance's) for a text that calls one of ``functions`` (each a
    name and its parameters' JSON Schema) as gpt-oss does, for the calls ``tool_choice``
    ``required`` or a named function asks for: analysis messages, each free text, then a
    ``commentary`` message to ``functions.NAME`` whose content is compact JSON the
    function's schema allows (then an end token, ``<|call|>``). The markers are the
    tokenizer's special tokens, which free text cannot write."""
    rules = [
        "start: thought* call",
        f'thought: {CHANNEL} "analysis" {MESSAGE} TEXT {END} {START} "assistant"',
        "call: " + " | ".join(f"call_{k}" for k in range(len(functions))),
        r"TEXT: /(.|\n)*/",
    ]
    for k, (name, schema) in enumerate(functions):
        header = json.dumps(f"commentary to={FUNCTIONS}{name} ")
        args = {**schema, "x-guidance": {"whitespace_flexible": False}}
        rules.append(f'call_{k}: {CHANNEL} {header} {CONSTRAIN} "json" {MESSAGE} args_{k}')
        rules.append(f"args_{k}: %json {json.dumps(args)}")
    return "\n".join(rules)


def auto_grammar(functions: Sequence[tuple[str, dict[str, Any] | None, bool]]) -> str:
    """A Lark grammar for a gpt-oss text under ``tool_choice`` ``auto`` with ``strict``
    functions (each a name, its parameters' JSON Schema, whether strict): messages as
    free as ever (any channel, any recipient but a function: ``to=browser.search`` too),
    but a message to ``functions.NAME`` is one of ``functions``, written
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``, its content
    compact JSON (a strict function's arguments as its schema allows, another's any
    object); a call is the last message (``<|call|>`` ends the generation)."""
    rules = [
        f'start: (free {END} {START} "assistant")* (free | call)',
        f"free: {CHANNEL} HEADER {MESSAGE} TEXT",
        r"HEADER: /[^<]*/ & ~/(?s:.*)to=functions(?s:.*)/",
        r"TEXT: /(.|\n)*/",
        "call: " + " | ".join(f"call_{k}" for k in range(len(functions))),
    ]
    for k, (name, params, strict) in enumerate(functions):
        schema = params if strict and params else {"type": "object"}
        header = json.dumps(f"commentary to={FUNCTIONS}{name} ")
        args = {**schema, "x-guidance": {"whitespace_flexible": False}}
        rules.append(f'call_{k}: {CHANNEL} {header} {CONSTRAIN} "json" {MESSAGE} args_{k}')
        rules.append(f"args_{k}: %json {json.dumps(args)}")
    return "\n".join(rules)
