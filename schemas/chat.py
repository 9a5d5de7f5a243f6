"""A chat as a request carries it: its messages (OpenAI's, with vLLM's ``reasoning``), their
text parts, and the bounds of the chat template options a request may bring."""

from __future__ import annotations

from typing import Final, Literal

from pydantic import AliasChoices, Field, model_validator

from .tools import MAX_TOOLS, PastToolCall
from .wire import _Strict

MAX_TEMPLATE_KWARGS_CHARS: Final = 4_096
"""The most chars a request's ``chat_template_kwargs`` take as JSON."""
MAX_CHAT_TEMPLATE_CHARS: Final = 65_536
"""The longest chat template a request brings (``chat_template``)."""
UNTRUSTED_TEMPLATE: Final = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
"""vLLM's words refusing a request's ``chat_template`` to a model that does not trust one
(its ``trust_request_chat_template`` option off), as a worker and a gateway say them."""
TEMPLATE_NAMES: Final = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens",
})  # fmt: skip
"""Arguments of ``apply_chat_template`` that ``chat_template_kwargs`` may not set."""


class TextPart(_Strict):
    """One part of a message's content, OpenAI's: ``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One turn of a chat, rendered with the model's chat template."""

    role: str = Field(pattern=r"^[a-z_]{1,32}$")
    """``system``, ``user``, ``assistant``, ``tool`` (or another role the template knows)."""
    content: str | list[TextPart] | None = None
    """The text, or its text parts (the template takes them joined by newlines, or as
    parts: the model's ``chat_template_content_format``); null (or left out) only in an
    assistant turn that made ``tool_calls``."""
    tool_calls: list[PastToolCall] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    """An assistant turn's calls of the request's tools (OpenAI's)."""
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)
    """A ``tool`` turn: the call it answers."""
    name: str | None = Field(None, min_length=1, max_length=64)
    reasoning_content: str | None = Field(
        None, validation_alias=AliasChoices("reasoning_content", "reasoning")
    )
    """An assistant turn's reasoning (a result's ``reasoning_content``; vLLM's, also as
    ``reasoning``): given to the chat template as ``reasoning_content`` (Qwen3's and
    DeepSeek-R1's templates write it back for the turns of a tool-calling loop), as
    ``reasoning`` (vLLM gives both) and as ``thinking`` (gpt-oss's)."""

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message's content is null only when it makes tool_calls")
        return self

    @property
    def chars(self) -> int:
        """Its text's size: the content, the calls' arguments and the reasoning."""
        calls = sum(len(c.function.arguments) for c in self.tool_calls or ())
        text = (
            sum(len(p.text) for p in self.content)
            if isinstance(self.content, list)
            else len(self.content or "")
        )
        return text + calls + len(self.reasoning_content or "")
