"""Out-of-memory back-off: lower a model's batch caps after an OOM, probe back up later.

AIMD, as TCP does with congestion: an OOM at ``(rows, padded_tokens)`` halves both caps
below that batch (we cannot tell which one ran out, and activation memory grows with
both); after :data:`PROBE_AFTER_S` without an OOM the caps grow by a quarter, step by
step, back to the policy's. An OOM while probing doubles the time between probes (up
to :data:`MAX_PROBE_AFTER_S`), so a model that really does not fit stops being retried
often; a full recovery resets it.
"""

from __future__ import annotations

from .types import Batch, Policy

BACKOFF = 0.5
"""Caps after an OOM, as a share of the failing batch."""
PROBE_STEP = 1.25
"""Growth of the caps per probe."""
PROBE_AFTER_S = 10.0
MAX_PROBE_AFTER_S = 600.0


class MemoryGuard:
    """The caps currently safe for one model, below or at its policy's."""

    def __init__(self) -> None:
        self._rows: int | None = None
        self._tokens: int | None = None
        self._token_ceiling = 0
        self._probe_after = PROBE_AFTER_S
        self._next_probe: float | None = None
        self.ooms = 0

    @property
    def backed_off(self) -> bool:
        return self._rows is not None or self._tokens is not None

    def row_cap(self, policy: Policy) -> int:
        cap = max(1, policy.max_batch_size)
        return cap if self._rows is None else min(cap, self._rows)

    def token_cap(self, policy: Policy) -> int | None:
        if self._tokens is None:
            return policy.max_batch_tokens
        if policy.max_batch_tokens is None:
            return self._tokens
        return min(policy.max_batch_tokens, self._tokens)

    def out_of_memory(self, batch: Batch, now: float, policy: Policy) -> None:
        """Halve both caps below the failing batch and schedule the next probe."""
        self.ooms += 1
        if self.backed_off:
            self._probe_after = min(self._probe_after * 2, MAX_PROBE_AFTER_S)
        rows = min(batch.rows, self.row_cap(policy))
        self._rows = max(1, int(rows * BACKOFF))
        padded = batch.padded_tokens
        current = self.token_cap(policy)
        if current is not None:
            padded = min(padded, current)
        self._tokens = max(1, int(padded * BACKOFF))
        self._token_ceiling = max(batch.padded_tokens, 1)
        self._next_probe = now + self._probe_after

    def tick(self, now: float, policy: Policy) -> None:
        """Probe back up one step if it is time."""
        if self._next_probe is None or now < self._next_probe:
            return
        if self._rows is not None:
            grown = max(self._rows + 1, int(self._rows * PROBE_STEP))
            self._rows = None if grown >= policy.max_batch_size else grown
        if self._tokens is not None:
            grown = max(self._tokens + 1, int(self._tokens * PROBE_STEP))
            limit = policy.max_batch_tokens
            # Without a policy cap, lift ours once it is well past the batch that failed.
            done = grown >= limit if limit is not None else grown >= 2 * self._token_ceiling
            self._tokens = None if done else grown
        if self.backed_off:
            self._next_probe = now + self._probe_after
        else:
            self._next_probe = None
            self._probe_after = PROBE_AFTER_S
