"""A unary request with more inputs than one fleet request takes, split into parts and
its parts' results merged back into one.

OpenAI's ``/v1/embeddings`` takes up to 2,048 inputs (LangChain sends 1,000 at a time); a
fleet request takes the model's ``max_inputs`` (64 unless its fleet file or its batch size
lowers it; workers publish it at ``bf:{model}:limits``) within ``max_entry_bytes``. Each part is a fleet
request of its own (``<id>.0``, ``<id>.1``, ...), so parts spread over the workers.
Rankings are not split: one ranking input holds its documents (``max_documents``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from ...schemas.keys import REQUEST_ID
from ...schemas.messages import Result, Usage
from .endpoint import Submission
from .errors import ApiError, invalid

MAX_INPUTS: Final = 2048
"""Inputs one HTTP request may hold (OpenAI's bound for embeddings)."""
SPLIT: Final = ("inputs", "pairs")
"""The submission options that list inputs."""
ITEM_OVERHEAD: Final = 16
"""Bytes an input adds to an entry besides its text (msgpack framing, generously)."""


def split(sub: Submission, max_inputs: int, max_entry_bytes: int) -> list[Submission]:
    """``sub`` as parts of at most ``max_inputs`` inputs and half ``max_entry_bytes`` of
    text each (a text longer than that goes alone; the producer judges it)."""
    key = next((k for k in SPLIT if isinstance(sub.options.get(k), list)), None)
    if key is None:
        return [sub]
    items: list[Any] = sub.options[key]
    if len(items) > MAX_INPUTS:
        raise ApiError(400, f"{len(items)} inputs: at most {MAX_INPUTS} in one request",
                       code="too_large", param="input")  # fmt: skip
    budget = max_entry_bytes // 2
    parts: list[list[Any]] = [[]]
    size = 0
    for item in items:
        cost = _size(item)
        if parts[-1] and (len(parts[-1]) == max_inputs or size + cost > budget):
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += cost
    return [Submission(sub.model, sub.options | {key: part}) for part in parts]


def _size(item: Any) -> int:
    texts = item if isinstance(item, tuple | list) else (item,)
    return ITEM_OVERHEAD + sum(len(t.encode()) for t in texts if isinstance(t, str))


def part_ids(base: str, parts: int) -> list[str]:
    """Fleet request ids of ``parts`` parts of the request ``base``: ``base`` itself when
    whole, else ``base.0``, ``base.1``, ..."""
    if parts == 1:
        return [base]
    ids = [f"{base}.{k}" for k in range(parts)]
    if not REQUEST_ID.match(ids[-1]):
        most = 128 - len(f".{parts - 1}")
        raise invalid(f"split in {parts} fleet requests, a request id has at most {most} "
                      "characters", "request_id")  # fmt: skip
    return ids


def merged(results: Sequence[Result]) -> Result:
    """The ``ok`` results of a request's parts as one: outputs in order, usage summed."""
    if len(results) == 1:
        return results[0]
    outputs = [o for r in results for o in r.outputs or []]
    truncated = (
        None
        if any(r.truncated is None for r in results)
        else [t for r in results for t in r.truncated or []]
    )
    tokens = sum(r.usage.prompt_tokens for r in results if r.usage is not None)
    usage = Usage(prompt_tokens=tokens) if any(r.usage is not None for r in results) else None
    update = {"outputs": outputs, "truncated": truncated, "usage": usage}
    return results[0].model_copy(update=update)
