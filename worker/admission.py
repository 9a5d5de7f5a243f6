"""Taking new entries in: decode, validate and prepare them; answer the bad ones at once.

The loop thread hands each batch of entries the intake read to :meth:`Admission.admit`:
an entry that cannot be computed (malformed, over a limit, delivered too often, or that
the runner's CPU side refuses) is answered — or dead-lettered when nobody can be — and
never reaches the scheduler; the others are prepared in one call and held by it. Kept
apart from ``loop.py``, which owns the loop thread and its lifecycle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..config import ModelConfig, WorkerConfig
from ..schemas.codec import EntryRejected, decode_entry, envelope_of
from ..schemas.errors import ErrorCode
from ..schemas.messages import Format, Request
from .answers import Answerer, Held, Outgoing, dead_reason, waiting_of
from .blobs import with_fetched
from .runner import Prepared, PrepareError, Runner
from .sink import ResultSink
from .stats import LoopStats
from .streams import Entry

logger = logging.getLogger(__name__)


class Admission:
    """Admits one model's new entries (loop thread only; no state of its own)."""

    def __init__(
        self,
        model: str,
        config: ModelConfig,
        worker: WorkerConfig,
        runner: Runner,
        answers: Answerer,
        stats: LoopStats,
    ) -> None:
        self.model = model
        self.config = config
        self.worker = worker
        self.runner = runner
        self.answers = answers
        self.stats = stats

    def admit(
        self,
        entries: Sequence[Entry],
        now: float,
        hold: Callable[[Held], None],
        sink: ResultSink,
    ) -> None:
        """Decode, validate and prepare new entries; ``hold`` the good ones (the
        scheduler's ``admit``), answer the bad ones at once through ``sink``."""
        limits = self.config.limits
        fresh: list[tuple[Entry, Request, Format]] = []
        out: list[Outgoing] = []
        for entry in entries:
            try:
                request, fmt = decode_entry(entry.fields, self.model, limits)
            except EntryRejected as exc:
                self._reject(entry, exc, now, out, sink)
                continue
            if entry.deliveries > self.worker.max_deliveries:
                reason = dead_reason(entry, self.worker.max_deliveries)
                env = envelope_of(entry.fields, limits)
                self._reject(
                    entry, EntryRejected(reason, ErrorCode.POISONED, env), now, out, sink, dead=True
                )
                continue
            fresh.append((entry, with_fetched(request, entry.blobs), fmt))
        prepared = self._prepare([req for _, req, _ in fresh]) if fresh else []
        lanes: list[int] = []
        for (entry, request, fmt), prep in zip(fresh, prepared, strict=True):
            if isinstance(prep, PrepareError):
                out.append(self.answers.error(entry, request, fmt, prep.code, str(prep), now))
                continue
            hold(Held(entry, request, fmt, prep, waiting_of(entry, request, prep), now))
            lanes.append(entry.lane)
        self.stats.received(lanes)
        sink.send(out)

    def _prepare(self, requests: list[Request]) -> list[Prepared | PrepareError]:
        """The runner's CPU side; a runner that raises or miscounts fails the requests."""
        try:
            prepared = self.runner.prepare_many(requests)
            if len(prepared) == len(requests):
                return prepared
            problem = f"returned {len(prepared)} prepared for {len(requests)} requests"
        except Exception as exc:
            logger.exception("runner %s failed to prepare requests", self.runner.name)
            problem = f"failed: {type(exc).__name__}: {exc}"
        error = PrepareError(f"runner {self.runner.name} {problem}", ErrorCode.INTERNAL)
        return [error] * len(requests)

    def _reject(
        self,
        entry: Entry,
        exc: EntryRejected,
        now: float,
        out: list[Outgoing],
        sink: ResultSink,
        dead: bool = False,
    ) -> None:
        """An entry that will not be computed: answer it when its id can be read; dead-letter
        it when it cannot (nobody to answer), or when ``dead`` (poison: operators look). The
        answer goes first: dead-lettering removes the entry, and it must not go unanswered."""
        self.stats.rejected(exc.code.value)
        answer = self.answers.rejected(entry, exc, now)
        if answer is not None and dead:
            sink.send([answer])
        elif answer is not None:
            out.append(answer)
        if dead or answer is None:
            sink.dead_letter(entry, exc.code.value, str(exc))
