"""What a worker publishes of its model's tokenizer at ``bf:{model}:tokenizer`` for the
gateway's ``GET /tokenizer_info``: vLLM's body (its ``TokenizerInfo.to_dict``), the
tokenizer's ``init_kwargs`` (its ``tokenizer_config.json``, as loaded) less the vocabulary
files' paths, with ``tokenizer_class`` and the chat template the worker renders with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SCALARS = (str, int, float, bool, type(None))
PATHS = ("vocab_file", "merges_file")
"""Local file paths: of no use to a client (vLLM's leaves them out too)."""


def tokenizer_info(runner: object) -> dict[str, Any] | None:
    """``runner``'s tokenizer's configuration (None: it has no tokenizer with
    ``init_kwargs``, a Hugging Face tokenizer's). An added token reads as its text (vLLM's
    ``content``); a value that is not JSON otherwise is left out (vLLM's answer would fail
    on it). ``chat_template``: the one chats render with here (the model's option where set,
    which replaced the tokenizer's own), as vLLM's shows its ``--chat-template``."""
    tokenizer = getattr(runner, "tokenizer", None)
    kwargs = getattr(tokenizer, "init_kwargs", None)
    if not isinstance(kwargs, Mapping):
        return None
    config = {k: v for k, v in kwargs.items() if isinstance(k, str) and k not in PATHS}
    out: dict[str, Any] = {}
    for key, value in config.items():
        kept = _json(value)
        if kept is not _DROP:
            out[key] = kept
    out["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        out["chat_template"] = template
    return out


_DROP = object()


def _json(value: Any) -> Any:
    """``value`` as JSON takes it (an added token: its text), or ``_DROP``."""
    if isinstance(value, SCALARS):
        return value
    if isinstance(getattr(value, "content", None), str):  # AddedToken
        return value.content
    if isinstance(value, Mapping):
        items = {str(k): _json(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _DROP}
    if isinstance(value, list | tuple):
        return [v for v in map(_json, value) if v is not _DROP]
    return _DROP
