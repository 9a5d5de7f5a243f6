"""The batching contract: what the worker hands the engine and what it gets back.

Times are seconds on the engine's clock (a float the caller supplies); nothing
here reads the wall clock, so every rule is testable in virtual time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Reason = Literal["full", "window", "idle", "deadline", "starvation", "retry", "step"]
"""Why a batch left: it filled a cap, its window ran out, the device was idle and
waiting would not pay, a member's deadline forced it, or a starved lane forced it.
``retry`` is the worker's own: a redelivered request runs alone (it may be the one that
crashed its last worker), so a poison request cannot take healthy batch-mates down.
``step`` is one step of a continuous (generating) runner: its items are the requests it
admits."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """One request waiting to be batched."""

    key: str
    """Caller's handle (the worker uses the stream entry id)."""
    lane: int
    """Priority lane, 0 = highest."""
    arrived: float
    """When it entered the queue."""
    tokens: int
    """Longest input's token count (padding is to the longest row)."""
    size: int = 1
    """Rows it adds to a batch (number of inputs)."""
    deadline: float | None = None
    """Latest time its batch may *finish*; ``None`` = no deadline."""


@dataclass(frozen=True, slots=True)
class Batch:
    """A micro-batch to run now."""

    items: tuple[Waiting, ...]
    reason: Reason

    @property
    def rows(self) -> int:
        return sum(w.size for w in self.items)

    @property
    def padded_tokens(self) -> int:
        """Tokens computed after padding every row to the longest one."""
        return self.rows * max((w.tokens for w in self.items), default=0)

    @property
    def real_tokens(self) -> int:
        return sum(w.tokens * w.size for w in self.items)

    @property
    def padding_waste(self) -> float:
        """Share of padded tokens that are padding (0.0 … 1.0)."""
        padded = self.padded_tokens
        return 0.0 if padded == 0 else 1.0 - self.real_tokens / padded


@dataclass(frozen=True, slots=True)
class Plan:
    """The engine's answer to one call of :meth:`Engine.plan`.

    ``batch``: run it now (``None``: nothing to run yet).
    ``expired``: requests whose deadline cannot be met; answer them ``expired``
    without computing them.
    ``wake_at``: call ``plan`` again by this time even if nothing new arrives
    (``None``: only when something arrives or the device frees up).
    """

    batch: Batch | None = None
    expired: tuple[Waiting, ...] = ()
    wake_at: float | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    """Per-model batching knobs (validated by the worker's config)."""

    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    max_batch_tokens: int | None = None
    preferred_batch_sizes: tuple[int, ...] = ()
    lane_weights: tuple[float, ...] = (4.0, 2.0, 1.0)
    max_starvation_ms: float = 2000.0
    adaptive: bool = True
    """False: a fixed window of ``max_wait_ms`` from the oldest request (benchmarks)."""

    lanes: int = field(default=3)
