"""What the text-generation runner needs of an engine, and the two it can use.

- :class:`~.padded.PaddedEngine` (``engine = "padded"``, the default): our step loop over
  one left-padded batch and transformers' cache classes.
- :class:`~.paged.PagedEngine` (``engine = "paged"``): transformers' own paged
  continuous batching, stepped by us; it also serves sliding-window and hybrid models.

Both serve LoRA adapters (:mod:`.lora`) and prompt log-probabilities.

Either way the worker's scheduler decides which sequences join and leave; the engine
runs exactly one step per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Protocol

from .lora import Adapter
from .sampling import Logprob, Sampling


@dataclass(slots=True)  # not frozen: one per row and step (4x cheaper to build)
class Output:
    """A sequence's tokens generated since it was (re)added, and whether it finished."""

    sequence: str
    tokens: list[int]
    finished: bool


@dataclass(frozen=True, slots=True)
class SeqState:
    context: int
    prefill_left: int


_STATE_FIELDS = ("context", "prefill_left")
if tuple(f.name for f in fields(SeqState)) != _STATE_FIELDS:
    raise RuntimeError("SeqState's fields changed: update seq_state() below")
_NEW_STATE = object.__new__
_SET_CONTEXT, _SET_PREFILL = (getattr(SeqState, name).__set__ for name in _STATE_FIELDS)


def seq_state(context: int, prefill_left: int) -> SeqState:
    """``SeqState(context, prefill_left)``, equal to it, at about half its cost: its slots
    set directly, not through the frozen ``__init__``. The runner asks one per running
    sequence and step (64 rows: about 25 us a step on the device thread)."""
    s = _NEW_STATE(SeqState)
    _SET_CONTEXT(s, context)
    _SET_PREFILL(s, prefill_left)
    return s


class Engine(Protocol):
    """One model's continuous batching, stepped by the caller."""

    adapters: tuple[Adapter | None, ...]
    """Its LoRA adapters by label less one (None: a label taken away)."""

    def add(self, sequence: str, tokens: list[int], max_new_tokens: int,
            sampling: Sampling, priority: int = 0,
            score: int | None = None, salt: str | None = None,
            lora: int = 0) -> None: ...  # fmt: skip
    def cancel(self, sequences: Iterable[str]) -> None: ...
    def forget(self, sequence: str) -> None: ...
    def step(self) -> list[Output]: ...
    def state(self, sequence: str) -> SeqState | None: ...
    def set_step_tokens(self, tokens: int) -> None: ...
    def reset(self) -> None: ...
    def forget_all(self) -> None: ...
    def logprobs(self, sequence: str) -> list[Logprob]: ...
    def prompt_logprobs(self, sequence: str) -> list[Logprob]: ...
    def cached(self, sequence: str) -> int: ...
    def fuse_adapter(self, adapter: Adapter) -> Adapter: ...
    def set_adapter(self, label: int, adapter: Adapter | None) -> None: ...
