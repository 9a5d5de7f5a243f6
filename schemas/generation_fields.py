"""Tables of a request's generation fields: their fixed bounds (vLLM's and OpenAI's where
they have one), which fields only generation models take, and which beam search refuses.
Apart from :mod:`.request` so that its model holds fields and checks only."""

from __future__ import annotations

from typing import Final

MAX_STOP_TOKEN_IDS: Final = 64
"""The most token ids a request's ``stop_token_ids`` lists."""
MAX_TOP_LOGPROBS: Final = 20
"""The most alternatives a generated token's log-probabilities list (``logprobs``)."""
MAX_LOGIT_BIAS: Final = 300
"""The most tokens a request's ``logit_bias`` lists (OpenAI's bound)."""
MAX_ALLOWED_TOKEN_IDS: Final = 8_192
"""The most token ids a request's ``allowed_token_ids`` lists."""
MAX_BAD_WORDS: Final = 128
"""The most words a request's ``bad_words`` lists (each 1 to 256 chars)."""
MAX_COMPLETIONS: Final = 16
"""The most completions a generation request asks per input (``n``)."""

BEAM_REFUSES: Final[dict[str, object]] = {
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_new_tokens": 0, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
    "logprobs": None, "prompt_logprobs": None, "structured_outputs": None,
    "response_format": None, "tools": None, "thinking_token_budget": None,
}  # fmt: skip
"""The fields ``use_beam_search`` does not take, but for their value that changes nothing
(``temperature`` and ``seed`` it takes: each round draws a token, as vLLM's rounds do)."""
GENERATION_FIELDS: Final = (
    "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_new_tokens", "logprobs",
    "stop_token_ids", "n", "logit_bias", "ignore_eos", "min_p",
    "include_stop_str_in_output", "truncate_prompt_tokens", "prompt_logprobs",
    "structured_outputs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "allowed_token_ids", "skip_special_tokens", "bad_words", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "return_token_ids", "cache_salt",
    "reasoning_effort", "return_prompt_text", "lora",
    "add_special_tokens", "return_token_strs",
    "use_beam_search", "length_penalty", "thinking_token_budget", "chat_template",
)  # fmt: skip
"""Request fields only generation models take."""
