"""batchfleet's generation results and errors → Anthropic's Messages API answers.

A message's ``content`` is its blocks in order: the reasoning (a ``thinking`` block, with
an empty ``signature``: nothing signs it), the answer (``text``), the calls (``tool_use``,
``input`` the parsed arguments). ``stop_reason`` is Anthropic's for the fleet's
``finish_reason`` (``stop_sequence`` where the output's ``stop_reason`` names the stop
string); the fleet's own ``deadline`` and ``cancelled`` are kept as they are.
"""

from __future__ import annotations

import json
from typing import Any

from ...schemas.messages import Generation, Result, Usage
from .errors import ApiError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error ``type`` per HTTP status (another: ``api_error`` from 500 on, else
``invalid_request_error``)."""

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error object (the status is the chat route's for the same error)."""
    kind = ERROR_TYPES.get(error.status,
                           "api_error" if error.status >= 500 else "invalid_request_error")  # fmt: skip
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def stop_reason(g: Generation) -> str:
    """``end_turn``, ``max_tokens``, ``tool_use`` (a ``stop`` that made calls),
    ``stop_sequence`` (one of ``stop_sequences`` ended it: :func:`stop_sequence`)."""
    if g.finish_reason == "stop" and g.tool_calls:
        return "tool_use"
    if stop_sequence(g) is not None:
        return "stop_sequence"
    return STOP_REASONS.get(g.finish_reason, g.finish_reason)


def stop_sequence(g: Generation) -> str | None:
    """The stop string that ended ``g`` (a stop token id, as ``stop_token_ids`` sends,
    is an ``end_turn``: Anthropic's ``stop_sequence`` is a string)."""
    if g.finish_reason == "stop" and isinstance(g.stop_reason, str):
        return g.stop_reason
    return None


def usage(u: Usage | None) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt tokens not read from the
    prefix cache, ``cache_read_input_tokens`` those read from it (they add up to the
    prompt)."""
    cached = u.prompt_tokens_details.cached_tokens if u and u.prompt_tokens_details else 0
    return {
        "input_tokens": (u.prompt_tokens if u else 0) - cached,
        "output_tokens": u.completion_tokens if u else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def envelope(id: str, model: str, content: list[dict[str, Any]], g: Generation | None,
             used: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """A ``message`` object (whole, or opening a stream with no content yet: no ``g``)."""
    stop = (stop_reason(g), stop_sequence(g)) if g is not None else (None, None)
    return {"id": id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": used}  # fmt: skip


def message(result: Result, id: str) -> dict[str, Any]:
    """The whole answer."""
    (g,) = result.generations()
    content: list[dict[str, Any]] = []
    if g.reasoning_content:
        content.append({"type": "thinking", "thinking": g.reasoning_content, "signature": ""})
    text = g.content if g.content is not None else g.text
    if text:
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": c.id, "name": c.function.name,
                 "input": json.loads(c.function.arguments)} for c in g.tool_calls or ()]  # fmt: skip
    return envelope(id, result.model, content, g, usage(result.usage))
