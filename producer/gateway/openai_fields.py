"""OpenAI's (and vLLM's) generation request fields → batchfleet's submit options.

Pure translation: what the fleet itself checks (bounds, types, the model's limits) is left
to :func:`~batchfleet.producer.submit.build_request` and the worker, whose refusals the
gateway answers as 400s; here only the shapes the translation reads are checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...schemas.inputs import TokenPrompt
from .endpoint import Submission
from .errors import invalid

SAME_NAME = (
    "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "stop_token_ids", "n", "ignore_eos",
    "include_stop_str_in_output", "truncate_prompt_tokens", "prompt_logprobs",
    "structured_outputs", "response_format", "allowed_token_ids", "skip_special_tokens",
    "bad_words", "return_token_ids", "cache_salt", "priority", "deadline_ms",
    "use_beam_search", "length_penalty", "thinking_token_budget",
)  # fmt: skip
"""Fields batchfleet takes under the same name and meaning (vLLM's extras included;
``priority`` is the lane, 0 first, as vLLM's lower-first priority; ``deadline_ms`` is
batchfleet's own)."""

CHAT_SAME_NAME = (
    "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "chat_template",
    "add_generation_prompt", "continue_final_message", "reasoning_effort",
)  # fmt: skip
"""A chat's own (``chat_template``: the worker renders it where the model trusts request
templates, else answers ``invalid_request``, as vLLM)."""

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip
"""vLLM's older constraint fields → ``structured_outputs`` keys."""

TOKEN_IDS = "return_tokens_as_token_ids"
"""vLLM's: logprobs name each token ``token_id:{id}`` (the gateway's answers read it)."""

NOT_TAKEN: dict[str, tuple[tuple[object, ...], str]] = {
    "prompt_embeds": ((), "prompt embeddings come as torch-serialized tensors (pickle), which "
                      "this gateway never loads: send the prompt as text or token ids"),
    "logprob_token_ids": ((), "log-probabilities are of the likeliest tokens "
                          "(logprobs / top_logprobs), not of chosen ids"),
    "include_reasoning": ((True,), "the reasoning is always returned (reasoning_content)"),
    "watermarking": ((False,), "texts are not watermarked"),
    "spaces_between_special_tokens": ((True,), "special tokens' text is decoded as the "
                                      "tokenizer joins it"),
    "truncation_side": (("left",), "truncate_prompt_tokens keeps a prompt's last tokens "
                        "(left) only"),
    "documents": ((), "chat templates are given no documents (put them in the messages)"),
    "media_io_kwargs": ((), "this gateway takes text only"),
    "mm_processor_kwargs": ((), "this gateway takes text only"),
    "routed_experts_prompt_start": ((0,), "no routed-expert data is returned"),
    "kv_transfer_params": ((), "the fleet has no disaggregated prefill"),
    "ec_transfer_params": ((), "the fleet has no disaggregated encoder cache"),
    "vllm_xargs": ((), "no extension of the fleet reads them"),
    "repetition_detection": ((), "repeated n-grams do not end a text: bound it with "
                             "max_tokens or stop"),
}  # fmt: skip
"""vLLM's request fields batchfleet does not take, but for the values (and null) that
change nothing: any other is a 400 that names the field, never silently ignored."""

MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
ROLE_ALIASES = {"developer": "system"}
"""OpenAI's ``developer`` role is its ``system`` (chat templates know the latter)."""


def _options(body: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {k: body[k] for k in names if body.get(k) is not None}


def refuse_not_taken(body: Mapping[str, Any], fields: Mapping[str, tuple[tuple[object, ...], str]]
                     = NOT_TAKEN) -> None:  # fmt: skip
    """A 400 naming the first of ``fields`` that ``body`` sets to a value that changes
    something (:data:`NOT_TAKEN`)."""
    for name, (plain, why) in fields.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(p) and value == p for p in plain):
            raise invalid(f"{name} is not supported: {why}", name)


def common(body: Mapping[str, Any], prompt_only: bool = False) -> dict[str, Any]:
    """The options both generation endpoints share. A ``max_tokens`` of 0 (the fleet's
    prompt only) is refused, as vLLM refuses it, unless ``prompt_only`` (an echo)."""
    refuse_not_taken(body)
    if not isinstance(body.get(TOKEN_IDS, False), bool | None):
        raise invalid(f"{TOKEN_IDS} must be a boolean", TOKEN_IDS)
    out = _options(body, SAME_NAME)
    if out.get("thinking_token_budget") == -1:  # vLLM's "no budget"
        del out["thinking_token_budget"]
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    limit = body.get(param)
    if limit == 0 and not prompt_only and not isinstance(limit, bool):
        raise invalid(f"{param} must be at least 1", param)
    if limit is not None:
        out["max_new_tokens"] = limit
    if body.get("min_tokens") is not None:
        out["min_new_tokens"] = body["min_tokens"]
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise invalid("logit_bias must map token ids to biases", "logit_bias")
        out["logit_bias"] = {str(k): v for k, v in bias.items()}
    guided = {v: body[k] for k, v in GUIDED.items() if body.get(k) is not None}
    if guided:
        if "structured_outputs" in out or len(guided) > 1:
            raise invalid("one constraint at most (guided_* or structured_outputs)")
        out["structured_outputs"] = guided
    if body.get("stream"):
        if body.get("use_beam_search"):  # (vLLM does not stream beams either)
            raise invalid("use_beam_search is not streamed: its beams are known only at the "
                          "end (ask without stream)", "use_beam_search")  # fmt: skip
        out["stream"] = True
    return out


def special_tokens(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """vLLM's ``add_special_tokens`` as an option, sent only where it is not the default
    (a text: true, a chat: false), so workers older than it serve the default."""
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise invalid("add_special_tokens must be a boolean", "add_special_tokens")
    return {} if special is None or special is not chat else {"add_special_tokens": special}


def model_of(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required", "model")
    return model


CHAT_NOT_TAKEN: dict[str, tuple[tuple[object, ...], str]] = {
    "echo": ((False,), "a chat's answer does not repeat its last message"),
}
"""A chat's own (:data:`NOT_TAKEN`): vLLM's chat ``echo``."""


def chat_submission(body: Mapping[str, Any]) -> Submission:
    """``/v1/chat/completions``."""
    model = model_of(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list", "messages")
    refuse_not_taken(body, CHAT_NOT_TAKEN)
    options = common(body) | _options(body, CHAT_SAME_NAME) | special_tokens(body, chat=True)
    options["messages"] = [message(m, i) for i, m in enumerate(raw)]
    if body.get("return_prompt_text"):  # vLLM's: the rendered template, in the answer
        options["return_prompt_text"] = True
    if body.get("logprobs"):
        options["logprobs"] = body.get("top_logprobs") or 0
    return Submission(model, options)


def message(m: Any, index: int) -> dict[str, Any]:
    """One OpenAI message as batchfleet's :class:`ChatMessage` map: content parts kept as
    text parts (the model's ``chat_template_content_format`` joins them or not; one part
    sent as its text, which every worker takes), fields batchfleet has no use for
    (``refusal``, ``audio``, ...) left out."""
    param = f"messages[{index}]"
    if not isinstance(m, Mapping):
        raise invalid("each message must be an object", param)
    out = {k: m[k] for k in MESSAGE_FIELDS if m.get(k) is not None}
    if m.get("reasoning") is not None and "reasoning_content" not in out:
        out["reasoning_content"] = m["reasoning"]
    role = out.get("role")
    if isinstance(role, str):
        out["role"] = ROLE_ALIASES.get(role, role)
    content = out.get("content")
    if isinstance(content, list):
        texts = part_texts(content, f"{param}.content")
        out["content"] = texts[0] if len(texts) == 1 else [
            {"type": "text", "text": t} for t in texts]  # fmt: skip
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [
            {k: c[k] for k in ("id", "type", "function") if k in c} if isinstance(c, Mapping)
            else c for c in calls
        ]  # fmt: skip
    return out


def joined(m: Any) -> Any:
    """A :func:`message` map with its text parts joined by newlines (for workers that take
    text only: ``ModelInfo.content_parts``)."""
    content = m.get("content") if isinstance(m, Mapping) else None
    if not isinstance(content, list):
        return m
    return {**m, "content": "\n".join(p["text"] for p in content)}


def text_parts(parts: list[Any], param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """OpenAI's content parts, of the text ``kinds`` only, joined by newlines (as vLLM
    does); ``param`` names the content in a refusal."""
    return "\n".join(part_texts(parts, param, kinds))


def part_texts(parts: list[Any], param: str, kinds: tuple[str, ...] = ("text",)) -> list[str]:
    """The texts of OpenAI's content parts, of the text ``kinds`` only (:func:`text_parts`)."""
    texts: list[str] = []
    for p in parts:
        if not isinstance(p, Mapping) or p.get("type") not in kinds:
            kind = p.get("type") if isinstance(p, Mapping) else type(p).__name__
            raise invalid(f"content part of type {kind!r}: this gateway takes text parts only",
                          param)  # fmt: skip
        text = p.get("text")
        if not isinstance(text, str):
            raise invalid("a text part's text must be a string", param)
        texts.append(text)
    return texts


def completion_submission(body: Mapping[str, Any]) -> Submission:
    """``/v1/completions``: ``prompt`` a text, texts, token ids, or lists of token ids."""
    model = model_of(body)
    if body.get("suffix") is not None:
        raise invalid("suffix is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise invalid("best_of other than n is not supported", "best_of")
    echo = bool(body.get("echo"))
    options = common(body, prompt_only=echo) | special_tokens(body, chat=False)
    texts = prompts(body)
    if body.get("logprobs") is not None:
        options["logprobs"] = body["logprobs"]
        if echo and "prompt_logprobs" not in options:  # the echoed prompt's, as vLLM's
            options["prompt_logprobs"] = body["logprobs"]
    if echo and not all(isinstance(p, str) for p in texts):
        options["return_prompt_text"] = True  # the echo of token ids: the worker decodes
    if echo and "logprobs" in options and body.get(TOKEN_IDS):
        options["return_token_ids"] = True  # the echoed text's first token, by its id
    options["inputs"] = [p if isinstance(p, str) else TokenPrompt(prompt_token_ids=p)
                         for p in texts]  # fmt: skip
    return Submission(model, options)


def prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """A completion request's prompts: texts or token-id lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [p]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p):
            return list(p)
    raise invalid("prompt must be a text, a list of texts, token ids or lists of them", "prompt")
