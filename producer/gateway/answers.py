"""batchfleet's generation results → OpenAI's answers (chat and text completions, whole).

The result's outputs are choices, in order (``n`` per input, input by input, as OpenAI
numbers them). ``finish_reason`` is batchfleet's (``stop``, ``length``, ``deadline``,
``cancelled``), ``tool_calls`` where a ``stop`` made calls, as OpenAI says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Final

from ...schemas.messages import Delta, Generation, Result, TokenLogprob, TopLogprob, Usage
from .endpoint import Answered
from .frontend import chat_role, timing_metrics
from .openai_fields import prompts

FLOOR: Final = -9999.0
"""A log-probability of -inf in the legacy shape (JSON has no infinity; vLLM's value)."""


def finish_reason(g: Generation) -> str:
    return "tool_calls" if g.tool_calls and g.finish_reason == "stop" else g.finish_reason


def usage(u: Usage | None) -> dict[str, Any]:
    """OpenAI's ``usage``."""
    prompt, completion = (u.prompt_tokens, u.completion_tokens) if u else (0, 0)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if u is not None and u.prompt_tokens_details is not None:
        out["prompt_tokens_details"] = {"cached_tokens": u.prompt_tokens_details.cached_tokens}
    return out


def as_token_ids(body: Mapping[str, Any]) -> bool:
    """vLLM's ``return_tokens_as_token_ids`` (the gateway set its default in ``body``):
    each logprobs token reads ``token_id:{id}``, so a client rebuilds a token that is not
    whole UTF-8 from its id."""
    return bool(body.get("return_tokens_as_token_ids"))


def token_id(token: int) -> str:
    """vLLM's ``format_token_id_placeholder``."""
    return f"token_id:{token}"


def chat_logprobs(lps: list[TokenLogprob] | None, as_ids: bool = False) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.
    ``as_ids``: each ``token`` is ``token_id:{id}``; the generated token's ``bytes`` stay
    its text's, an alternative's are its ``token``'s (vLLM's, both)."""
    if lps is None:
        return None

    def one(t: TopLogprob, top: bool) -> dict[str, Any]:
        token = token_id(t.token) if as_ids else t.text
        return {"token": token, "logprob": t.logprob,
                "bytes": list((token if top else t.text).encode())}  # fmt: skip

    return {"content": [one(t, False) | {"top_logprobs": [one(x, True) for x in t.top]}
                        for t in lps]}  # fmt: skip


def completion_logprobs(
    lps: Sequence[TokenLogprob | None] | None, offset: int = 0, head: str = "",
    as_ids: bool = False, head_id: int | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """OpenAI's legacy ``logprobs``: tokens, their log-probabilities, the likeliest at each
    position, and each token's character offset (from ``offset``) in the text. A null
    entry (an echoed prompt's first token: nothing precedes it) reads as ``head``, its
    log-probability and likeliest null, as vLLM writes it; -inf is -9999.0 (JSON). Each
    position's ``top_logprobs`` leads with its own token, then the likeliest: "up to
    logprobs+1 elements", OpenAI's rule, which vLLM keeps (its token is among them).
    ``as_ids``: tokens (and ``top_logprobs``' keys) read ``token_id:{id}`` (the null
    entry's where ``head_id`` is known), offsets still count the text's characters."""
    if lps is None:
        return None
    texts = [head if t is None else t.text for t in lps]

    def name(t: TopLogprob) -> str:
        return token_id(t.token) if as_ids else t.text

    tokens = [name(t) if t is not None else token_id(head_id) if as_ids and head_id is not None
              else head for t in lps]  # fmt: skip
    tops = [None if t is None else {name(x): max(x.logprob, FLOOR) for x in (t, *t.top)}
            for t in lps]  # fmt: skip
    return {
        "tokens": tokens,
        "token_logprobs": [None if t is None else max(t.logprob, FLOOR) for t in lps],
        "top_logprobs": tops,
        "text_offset": [offset + o for o in accumulate((len(t) for t in texts), initial=0)][:-1],
    }


@dataclass(frozen=True)
class Echo:
    """An echoed prompt, as a completion's text and ``logprobs`` begin with it."""

    text: str
    logprobs: dict[str, Any] | None
    """Its tokens' (the legacy shape), where asked and the worker scored the prompt."""
    end: int
    """The generated text's first character offset in ``text_offset`` terms."""


def echo_of(
    prompt: str | list[int], first: Generation | Delta, logprobs: bool, as_ids: bool = False
) -> Echo:
    """The echo of one input's ``prompt`` (as sent; token ids: the worker's
    ``prompt_text``) from its ``first`` output (``prompt_text``, ``prompt_logprobs``): a
    whole answer's and a stream's (a delta carries the same fields). ``as_ids``: its
    tokens as ids (the first's known from token ids sent, or ``prompt_token_ids``)."""
    text = prompt if isinstance(prompt, str) else first.prompt_text or ""
    ids = prompt if not isinstance(prompt, str) else first.prompt_token_ids
    head = ids[0] if as_ids and ids else None
    return scored_echo(text, first.prompt_logprobs if logprobs else None, as_ids, head)


def scored_echo(
    prompt: str, scored: Sequence[TokenLogprob | None] | None, as_ids: bool = False,
    head_id: int | None = None,
) -> Echo:  # fmt: skip
    """The echo of ``prompt`` with its tokens' log-probabilities where ``scored``. The
    first prompt token's text is what the prompt holds before the second's (none for a
    BOS that its text does not show)."""
    if scored is None:
        return Echo(prompt, None, len(prompt))
    rest = "".join(t.text for t in scored[1:] if t is not None)
    head = prompt[: len(prompt) - len(rest)] if prompt.endswith(rest) else ""
    lps = completion_logprobs(scored, head=head, as_ids=as_ids, head_id=head_id)
    assert lps is not None
    return Echo(prompt, lps, len(head) + len(rest))


def joined(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy ``logprobs`` one after the other (offsets already continuous)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: [*a[k], *b[k]] for k in a}


def prompt_logprobs(lps: list[TokenLogprob | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, null or ``{token id: {logprob, rank,
    decoded_token}}`` (the token itself, then the likeliest, ranked)."""
    if lps is None:
        return None
    out: list[Any] = []
    for t in lps:
        if t is None:
            out.append(None)
            continue
        entry = {str(t.token): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.text}}
        for rank, x in enumerate(t.top, 1):
            if str(x.token) in entry:
                entry[str(x.token)]["rank"] = rank
            else:
                entry[str(x.token)] = {"logprob": x.logprob, "rank": rank, "decoded_token": x.text}
        out.append(entry)
    return out


def assistant_message(g: Generation, role: str = "assistant") -> dict[str, Any]:
    """A choice's ``message``: the answer (``content``), the reasoning and the calls."""
    content: str | None = g.content if g.content is not None else g.text
    calls = [c.model_dump() for c in g.tool_calls or ()]
    if calls and not content:
        content = None
    return {
        "role": role,
        "content": content,
        "reasoning_content": g.reasoning_content,
        "reasoning": g.reasoning_content,
        "tool_calls": calls,
    }


def answered_extras(result: Result, answered: Answered) -> dict[str, Any]:
    """A whole answer's ``system_fingerprint`` and, where the gateway adds them, its
    per-request timing ``metrics``."""
    out: dict[str, Any] = {"system_fingerprint": answered.system_fingerprint}
    if answered.frontend.per_request_metrics:
        out["metrics"] = timing_metrics(result)
    return out


def chat_response(body: Mapping[str, Any], result: Result, answered: Answered) -> dict[str, Any]:
    """``chat.completion``."""
    gens = result.generations()
    role = chat_role(body, answered.frontend)
    choices = []
    for i, g in enumerate(gens):
        choice: dict[str, Any] = {
            "index": i,
            "message": assistant_message(g, role),
            "logprobs": chat_logprobs(g.logprobs, as_token_ids(body)),
            "finish_reason": finish_reason(g),
            "stop_reason": g.stop_reason,
        }
        if g.token_ids is not None:
            choice["token_ids"] = g.token_ids
        choices.append(choice)
    out: dict[str, Any] = {
        "id": answered.id,
        "object": "chat.completion",
        "created": answered.created,
        "model": result.model,
        "choices": choices,
        "usage": usage(result.usage),
        **answered_extras(result, answered),
    }
    if gens and gens[0].prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(gens[0].prompt_logprobs)
    if gens and gens[0].prompt_token_ids is not None:
        out["prompt_token_ids"] = gens[0].prompt_token_ids
    if gens and gens[0].prompt_text is not None:  # return_prompt_text: the rendered chat
        out["prompt_text"] = gens[0].prompt_text
    return out


def completion_response(
    body: Mapping[str, Any], result: Result, answered: Answered
) -> dict[str, Any]:
    """``text_completion``: with ``echo``, each choice's text (and ``logprobs``) begins
    with its prompt: as sent, or the worker's ``prompt_text`` for token ids."""
    gens = result.generations()
    texts = prompts(body)
    per_input = max(1, len(gens) // max(1, len(texts)))
    as_ids = as_token_ids(body)
    shown_ids = bool(body.get("return_token_ids"))  # (asked by the gateway for an echo's)
    choices = []
    for i, g in enumerate(gens):
        if body.get("echo"):
            scored = body.get("logprobs") is not None
            echo = echo_of(texts[i // per_input], gens[i - i % per_input], scored, as_ids)
            text = echo.text + g.text
            logprobs = joined(echo.logprobs,
                              completion_logprobs(g.logprobs, echo.end, as_ids=as_ids))  # fmt: skip
            logprobs = logprobs if scored else None
        else:
            text, logprobs = g.text, completion_logprobs(g.logprobs, as_ids=as_ids)
        choice: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(g),
            "stop_reason": g.stop_reason,
        }
        if g.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(g.prompt_logprobs)
        ids = gens[i - i % per_input].prompt_token_ids  # each choice its prompt's (vLLM's)
        if g.token_ids is not None and shown_ids:
            choice["token_ids"] = g.token_ids
        if ids is not None and shown_ids:
            choice["prompt_token_ids"] = ids
        choices.append(choice)
    return {
        "id": answered.id,
        "object": "text_completion",
        "created": answered.created,
        "model": result.model,
        "choices": choices,
        "usage": usage(result.usage),
        **answered_extras(result, answered),
    }
