"""In-process counters of one batch loop, for ``celery inspect stats`` and the demo summary."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .observers import Answered, BatchDone, DeadLettered, Generated, LoopEvent

RECENT = 2048


@dataclass(eq=False)
class LoopStats:
    model: str
    lanes: int
    requests: Counter[str] = field(default_factory=Counter)
    """Answered requests by status."""
    received_by_lane: Counter[int] = field(default_factory=Counter)
    rejected_by_code: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    rows: int = 0
    padded_tokens: int = 0
    real_tokens: int = 0
    oom_events: int = 0
    dead_letters: int = 0
    recent_batch_rows: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT))
    recent_total_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    generation: Generated | None = None
    """A generating model's state after its last step."""
    completion_tokens: int = 0
    preemptions: int = 0
    draft_tokens: int = 0
    """Speculative decoding: drafts proposed so far."""
    accepted_tokens: int = 0
    """Speculative decoding: drafts accepted so far."""
    skipped_rows: int = 0
    """Speculative decoding: rows that proposed nothing because a step's batch size turned
    speculation off, so far."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def received(self, lanes: Iterable[int]) -> None:
        """Requests admitted, one lane number each."""
        counts = Counter(lanes)
        with self._lock:
            self.received_by_lane.update(counts)

    def rejected(self, code: str) -> None:
        with self._lock:
            self.rejected_by_code[code] += 1

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, Answered):
            with self._lock:
                for a in event.replies:
                    self.requests[a.result.status] += 1
                    self.recent_total_ms.append(a.result.timings.total_ms)
                    if a.result.usage is not None:
                        self.completion_tokens += a.result.usage.completion_tokens
        elif isinstance(event, BatchDone):
            batch = event.batch
            with self._lock:
                self.batches += 1
                self.rows += batch.rows
                self.padded_tokens += batch.padded_tokens
                self.real_tokens += batch.real_tokens
                self.reasons[batch.reason] += 1
                self.recent_batch_rows.append(batch.rows)
                self.oom_events += int(event.out_of_memory)
        elif isinstance(event, DeadLettered):
            with self._lock:
                self.dead_letters += 1
        elif isinstance(event, Generated):
            with self._lock:
                self.generation = event
                self.preemptions += event.preempted
                self.draft_tokens += event.drafted[1]
                self.accepted_tokens += sum(event.accepted)
                self.skipped_rows += event.spec_skipped

    def snapshot(self) -> dict[str, Any]:
        """Plain JSON-able numbers (Celery sends them through the broker)."""
        with self._lock:
            waste = 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
            return {
                "model": self.model,
                "lanes": self.lanes,
                "requests": dict(self.requests),
                "received_by_lane": {str(k): v for k, v in self.received_by_lane.items()},
                "rejected": dict(self.rejected_by_code),
                "batches": self.batches,
                "rows": self.rows,
                "mean_batch_rows": round(self.rows / self.batches, 2) if self.batches else 0.0,
                "padding_waste": round(waste, 4),
                "dispatch_reasons": dict(self.reasons),
                "oom_events": self.oom_events,
                "dead_letters": self.dead_letters,
                **self._generation(),
            }

    def _generation(self) -> dict[str, Any]:
        g = self.generation
        if g is None:
            return {}
        usage = round(g.kv_tokens / g.kv_capacity, 4) if g.kv_capacity else 0.0
        return {"generation": {
            "running_sequences": g.running, "waiting_requests": g.waiting,
            "kv_cache_usage": usage, "completion_tokens": self.completion_tokens,
            "preemptions": self.preemptions, **self._speculation(),
        }}  # fmt: skip

    def _speculation(self) -> dict[str, Any]:
        """Speculative decoding's drafts and acceptance rate (none proposed: nothing), and
        the rows that skipped it (none: nothing)."""
        out: dict[str, Any] = {"spec_skipped_rows": self.skipped_rows} if self.skipped_rows else {}
        if not self.draft_tokens:
            return out
        return {"spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_acceptance": round(self.accepted_tokens / self.draft_tokens, 4), **out}  # fmt: skip
