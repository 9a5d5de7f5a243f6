"""Running one micro-batch on the device: isolate failures and split on out-of-memory.

A batch that raises is bisected so its good requests still succeed and only the
request that fails gets an error; an out-of-memory error splits the batch (down to
single rows) and is reported so the batching engine lowers its caps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .device import is_out_of_memory, release_cached_memory
from .handlers.base import Encoded, Handler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Failure:
    """A request whose computation raised."""

    message: str


@dataclass(slots=True)
class BatchOutcome:
    """One outcome per request (outputs list or Failure), and whether memory ran out."""

    outcomes: list[list[Any] | Failure]
    out_of_memory: bool = False
    calls: int = 0
    errors: list[str] = field(default_factory=list)


def run_batch(handler: Handler, groups: Sequence[Sequence[Encoded]]) -> BatchOutcome:
    """Run requests (each a group of rows) as one batch, falling back to halves on errors."""
    result = BatchOutcome(outcomes=[])
    result.outcomes = _run(handler, list(groups), result)
    return result


def _run(handler: Handler, groups: list[Sequence[Encoded]], acc: BatchOutcome) -> list[Any]:
    rows = [row for g in groups for row in g]
    acc.calls += 1
    try:
        flat = handler.run(rows)
        if len(flat) != len(rows):
            raise RuntimeError(f"handler returned {len(flat)} outputs for {len(rows)} rows")
    except Exception as exc:
        oom = is_out_of_memory(exc)
        if oom:
            acc.out_of_memory = True
            release_cached_memory(getattr(handler, "torch_device", None) or _cpu())
        acc.errors.append(f"{type(exc).__name__}: {exc}")
        if len(groups) > 1:
            mid = len(groups) // 2
            return _run(handler, groups[:mid], acc) + _run(handler, groups[mid:], acc)
        if oom and len(rows) > 1:
            mid = len(rows) // 2
            halves = [_run(handler, [rows[:mid]], acc)[0], _run(handler, [rows[mid:]], acc)[0]]
            if any(isinstance(h, Failure) for h in halves):
                return [next(h for h in halves if isinstance(h, Failure))]
            return [halves[0] + halves[1]]
        logger.warning("request failed in inference: %s", exc)
        return [Failure(f"{type(exc).__name__}: {exc}")]
    out: list[Any] = []
    i = 0
    for g in groups:
        out.append(flat[i : i + len(g)])
        i += len(g)
    return out


def _cpu() -> Any:
    import torch

    return torch.device("cpu")
