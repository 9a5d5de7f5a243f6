"""vLLM's ``/tokenize`` and ``/detokenize``, Anthropic's ``/v1/messages/count_tokens``.

The gateway holds no tokenizer: each is a fleet request with ``max_new_tokens`` 0 (the
prompt only, nothing generated), so the model's own worker tokenizes it exactly as it
would for a generation (the same chat template, the same ids); the answer is read from
its one output (``prompt_token_ids``, ``prompt_token_strs``, ``prompt_text``,
``prompt_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...schemas.inputs import TokenPrompt
from ...schemas.messages import Generation, Result
from . import anthropic_fields
from .endpoint import Answered, Endpoint, Submission
from .errors import ApiError, invalid
from .openai_fields import chat_submission, model_of, special_tokens

CHAT_FIELDS = ("messages", "tools", "chat_template_kwargs", "chat_template",
               "add_generation_prompt", "continue_final_message")  # fmt: skip
"""vLLM's ``TokenizeChatRequest`` fields the fleet honours (as the chat route takes them)."""


def tokenize_submission(body: Mapping[str, Any]) -> Submission:
    """``{model, prompt}`` or ``{model, messages, ...}`` → the prompt's token ids (and with
    ``return_token_strs``, the tokenizer's strings of them); ``add_special_tokens`` as vLLM
    takes it (default: a text's yes, a chat's no: its template has its own)."""
    model = model_of(body)
    strs = body.get("return_token_strs")
    if strs is not None and not isinstance(strs, bool):
        raise invalid("return_token_strs must be a boolean", "return_token_strs")
    chat = body.get("messages") is not None
    if chat:
        fields = {k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}
        options = chat_submission(fields | {"model": model}).options
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise invalid("prompt must be a non-empty text (or send messages)", "prompt")
        options = {"inputs": [prompt]}
    options |= special_tokens(body, chat)
    if strs:
        options["return_token_strs"] = True
    return Submission(model, options | {"max_new_tokens": 0, "return_token_ids": True})


def _first(result: Result, field: str) -> Generation:
    """The output, with ``field`` (a 500 where the worker left it out: one from before
    ``max_new_tokens`` 0)."""
    g = result.generations()[0]
    if getattr(g, field) is None:
        raise ApiError(500, f"the worker returned no {field}: is it older than the gateway?",
                       code="internal")  # fmt: skip
    return g


def tokenize_answer(body: Mapping[str, Any], result: Result, answered: Answered) -> dict[str, Any]:
    """vLLM's ``{count, max_model_len, tokens, token_strs}``; ``max_model_len`` is left out
    where the model's workers did not publish it (ones older than ``bf:{model}:info``)."""
    ids = _first(result, "prompt_token_ids").prompt_token_ids or []
    known = {} if answered.max_model_len is None else {"max_model_len": answered.max_model_len}
    strs = _first(result, "prompt_token_strs").prompt_token_strs if body.get(
        "return_token_strs") else None  # fmt: skip
    return {"count": len(ids), **known, "tokens": ids, "token_strs": strs}


def detokenize_submission(body: Mapping[str, Any]) -> Submission:
    """``{model, tokens}`` → their text, as the model reads them (special tokens kept)."""
    model = model_of(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens):  # fmt: skip
        raise invalid("tokens must be a non-empty list of token ids", "tokens")
    return Submission(model, {"inputs": [TokenPrompt(prompt_token_ids=tokens)],
                              "max_new_tokens": 0, "return_prompt_text": True})  # fmt: skip


def detokenize_answer(
    body: Mapping[str, Any], result: Result, answered: Answered
) -> dict[str, Any]:
    """vLLM's ``{prompt}``."""
    return {"prompt": _first(result, "prompt_text").prompt_text}


def count_submission(body: Mapping[str, Any]) -> Submission:
    """Anthropic's body (as ``/v1/messages`` takes it, no ``max_tokens``): its chat."""
    return anthropic_fields.submission(body, counting=True)


def count_answer(body: Mapping[str, Any], result: Result, answered: Answered) -> dict[str, Any]:
    """Anthropic's ``{input_tokens}``: the rendered chat's tokens."""
    return {"input_tokens": result.generations()[0].prompt_tokens}


TOKENIZE = Endpoint(tokenize_submission, tokenize_answer, "tokenize")
DETOKENIZE = Endpoint(detokenize_submission, detokenize_answer, "detokenize")
COUNT_TOKENS = Endpoint(count_submission, count_answer, "count")
