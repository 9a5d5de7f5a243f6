"""A failed text-generation step: out of memory, the running requests are preempted and
the step budget halves (until it cannot); any other failure fails the running requests
and the engine starts clean.
"""

from __future__ import annotations

import logging

from ...schemas.errors import ErrorCode
from ..device import release_cached_memory
from ..runner import Failed, StepEvent, StepReport
from .gen_requests import Requests
from .gen_state import GenReq

logger = logging.getLogger(__name__)


class Failures(Requests):
    """What a step that raised leaves behind."""

    def _out_of_memory(
        self, failure: str, events: list[StepEvent], report: StepReport
    ) -> StepReport:
        """A step ran out of memory: while the step budget can still shrink, every running
        request is preempted (its text kept, resumed by recomputation) and the per-step
        token budget halves (activations are what grows with it; the KV cache is allocated
        up front); after that, as any failed step."""
        running = self._stop_engine()
        release_cached_memory(self.torch_device)
        report.out_of_memory = True
        if self.step_tokens <= self.page_size:
            logger.error("generation step out of memory at the smallest step budget (%d "
                         "running): %s", len(running), failure)  # fmt: skip
            return self._fail(running, f"generation step failed: {failure}", events, report)
        self.step_tokens = max(self.page_size, self.step_tokens // 2)
        self.engine.set_step_tokens(self.step_tokens)
        logger.warning("out of memory in a generation step: %d requests preempted, step "
                       "budget now %d tokens", len(running), self.step_tokens)  # fmt: skip
        events += [self._park(r) for r in running]
        report.events = events
        return report

    def _failed_step(
        self, exc: Exception, events: list[StepEvent], report: StepReport
    ) -> StepReport:
        """A step failed (not for memory): every running request fails (a generation cannot
        be bisected mid-way) and the engine starts clean."""
        running = self._stop_engine()
        logger.error("generation step failed (%d running): %s", len(running), exc, exc_info=exc)
        message = f"generation step failed: {type(exc).__name__}: {exc}"
        return self._fail(running, message, events, report)

    def _stop_engine(self) -> list[GenReq]:
        """Empty the engine after a failed step; the requests that were running."""
        running = [r for r in self._reqs.values() if not r.parked]
        self.engine.reset()
        for r in running:  # the engine holds nothing now: nothing to cancel in it
            for seq in r.seqs:
                self._by_seq.pop(seq.name, None)
            if r.beams is not None:
                self._beam_cancel(r)
        return running

    def _fail(
        self, running: list[GenReq], message: str, events: list[StepEvent], report: StepReport
    ) -> StepReport:
        for r in running:
            events.append(self._built(Failed(r.key, message, ErrorCode.INFERENCE_FAILED)))
            self._reqs.pop(r.key, None)
            for seq in r.seqs:
                self.engine.forget(seq.name)
        report.events = events
        return report
