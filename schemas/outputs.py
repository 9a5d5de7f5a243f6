"""A generation's output for one input (an element of a result's ``outputs``): its text,
why it ended, its token counts, and what the request asked back (log-probabilities, token
ids, the prompt as read, tool calls, reasoning)."""

from __future__ import annotations

from typing import Final

from pydantic import Field

from .tools import ToolCall
from .wire import _Answer


class TopLogprob(_Answer):
    """A token and its log-probability at one position."""

    token: int
    """The token id."""
    text: str
    """The token alone, decoded (a piece of a character reads as U+FFFD)."""
    logprob: float


class TokenLogprob(TopLogprob):
    """A generated token, its log-probability, and the likeliest tokens at its position."""

    top: list[TopLogprob] = Field(default_factory=list)
    """The request's ``logprobs`` likeliest tokens, likeliest first."""
    rank: int | None = None
    """The token's rank at its position: 1 + the number of tokens strictly likelier
    (vLLM's); None from workers older than it."""


class Generation(_Answer):
    """A generation model's output for one input (an element of ``Result.outputs``)."""

    text: str
    finish_reason: str
    """``stop`` (end of sequence or a stop string), ``length`` (``max_new_tokens`` or the
    context), ``deadline`` (the request's deadline passed while generating), ``cancelled``;
    readers accept others."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Of ``prompt_tokens``, those its sequence did not prefill: from the prefix cache, or
    the prefill of the same prompt run with it (its request's other completions, or the
    same prompt sent at the same time)."""
    logprobs: list[TokenLogprob] | None = None
    """With the request's ``logprobs``: one per generated token (``completion_tokens`` of
    them, a stop string's and the end-of-sequence token's included), from the model's own
    distribution (before the request's rules, temperature, top-k and top-p); streamed in
    the deltas too."""
    token_ids: list[int] | None = None
    """With the request's ``return_token_ids``: the generated tokens (``completion_tokens``
    of them, as ``logprobs`` counts them); absent otherwise."""
    prompt_token_ids: list[int] | None = None
    """With ``return_token_ids``, in the first output of each input: the prompt's tokens
    (``prompt_tokens`` of them: a chat's rendered template, a truncated prompt's last)."""
    prompt_text: str | None = None
    """With the request's ``return_prompt_text``, in the first output of each input: the
    prompt's text as the model read it: a text input as sent (decoded from its tokens when
    ``truncate_prompt_tokens`` cut it), a chat's rendered template, ``prompt_token_ids``
    decoded (special tokens kept)."""
    prompt_token_strs: list[str] | None = None
    """With the request's ``return_token_strs``, in the first output of each input: the
    prompt's tokens as the tokenizer writes them (``prompt_tokens`` of them; e.g. ``Ġcat``)."""
    stop_reason: str | int | None = None
    """vLLM's: what ended a ``stop`` output: the request's stop string (``stop``) or stop
    token id (``stop_token_ids``) it met; null when an end-of-sequence token ended it, for
    any other ``finish_reason``, and from workers before it was added."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With the request's ``prompt_logprobs``, in the first output of each input: one per
    prompt token (``prompt_tokens`` of them), the first null (nothing precedes it), each
    other the token's log-probability given the tokens before it (vLLM's)."""
    tool_calls: list[ToolCall] | None = None
    """With the request's ``tools``: the calls its text makes (the text is kept as
    generated); absent when it makes none."""
    content: str | None = None
    """With the request's ``tools``, or from a model with a ``reasoning_parser``: the
    answer, the text outside the reasoning and the calls, trimmed (OpenAI's message
    ``content``; empty when the text is only those)."""
    reasoning_content: str | None = None
    """From a model with a ``reasoning_parser``: the text's reasoning (vLLM's), trimmed,
    without its ``<think>`` tags; absent when it has none."""


FINISH_REASONS: Final = ("stop", "length", "deadline", "cancelled")
