"""The model-handler seam: tokenize each request, collate a batch, run it, split outputs.

A handler owns one loaded model on one device. The worker calls ``encode`` on its
loop thread as requests arrive (so tokenizing overlaps the running batch), and
``run`` on its device thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Encoded:
    """One input text, tokenized and cut to the model's limit."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...]
    truncated: bool

    @property
    def tokens(self) -> int:
        return len(self.ids)


@runtime_checkable
class Handler(Protocol):
    """What the worker needs from a model. Implement it to serve your own model."""

    name: str
    """Kind of handler, for logs and stats (e.g. ``embedding``)."""
    device: str

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        """Tokenize texts (no padding); cut each to the model's max tokens."""
        ...

    def run(self, rows: Sequence[Encoded]) -> list[Any]:
        """Run one batch (padded to its longest row) and return one output per row.

        Outputs must be msgpack/JSON-able (lists, dicts, str, float, int, bool).
        Raise ``torch.cuda.OutOfMemoryError`` / ``MemoryError`` on memory exhaustion:
        the worker splits the batch and tells the batching engine.
        """
        ...

    def info(self) -> dict[str, Any]:
        """A few facts for ``inspect stats`` (device, dtype, max tokens...)."""
        ...
