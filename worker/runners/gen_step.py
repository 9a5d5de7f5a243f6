"""The phases of one text-generation step on the device thread, around the engine's own
step (``TextGenerationRunner.step`` runs them in order): the operators' changes taken,
the loop's work applied (stops, preemptions, admissions, compiled constraints), each
output row read into its sequence's text (stop tokens and strings, the end), the
requests it touched reported, and the report finished.
"""

from __future__ import annotations

from ...schemas.errors import ErrorCode
from ..generation.engine import Output
from ..runner import LOST, Failed, StepEvent, StepReport, Work
from .gen_controls import Controls
from .gen_failures import Failures
from .gen_state import GenReq, GenSeq


class Stepping(Failures, Controls):
    """One step's phases, before and after the engine steps."""

    def _settle_last(self) -> None:
        """The last step's report, settled here if its caller did not."""
        if self._unsettled is not None:
            self._unsettled.settle()
            self._unsettled = None

    def _carried_over(self, work: Work) -> list[StepEvent]:
        """The step before this one raised (a runner bug), maybe once its engine ran: its
        requests' texts moved on, the events it built lost with it. Those come first in
        this step's events, in the order built (a stream still adds up to its result; a
        request it ended, failed or parked is answered, or resumed later, as if it had
        returned), but for the requests it admitted (failed with it) or that this step
        stops as ``lost``. Then the requests it left mid-way end or go on
        (:meth:`_left_midway`). Its token counts are this step's too
        (:class:`~.gen_state.Unsent`); :mod:`..crashes` says what becomes of the requests
        it lost all the same."""
        unsent = self._unsent
        skip = {key for key, reason in work.stop if reason == LOST} | unsent.admitted
        unsent.events = [ev for ev in unsent.events if ev.key not in skip]
        events: list[StepEvent] = list(unsent.events)
        for r in [r for r in self._reqs.values() if r.key not in skip]:
            events += self._left_midway(r)
        return events

    def _left_midway(self, r: GenReq) -> list[StepEvent]:
        """A request as a step that raised left it: ended (its sequences all ended, its
        result not yet built; running, parked or waiting for its constraint alike) it ends
        now; a beam search whose searches all ended takes its best beams first, and one
        whose round advanced without the next round started starts it (only the rounds
        missing are added); a running one whose start, or a sequence's resume, it left
        part-done (rolled back, :meth:`_start`) starts the sequences the engine lacks once
        this step's engine step ran (:meth:`_restart_left`: an engine frees a name it was
        told to cancel with its next step, and takes it again only after). Its events, if
        it ended."""
        if not r.done and not r.parked and r.compiling is None:
            beams = r.beams
            if beams is None:
                if self._unstarted(r):
                    self._restart.append(r)
            elif beams.done:
                self._beam_results(r)
            else:
                self._start(r, beams.lane)
        return self._finish(r) if r.done else []

    def _restart_left(self) -> None:
        """Start the sequences that the requests a step that raised left part-started lack
        (those still running: not ended, parked or failed since)."""
        left, self._restart = self._restart, []
        for r in left:
            if self._reqs.get(r.key) is r and not r.parked and r.compiling is None:
                self._start(r, r.lane)

    def _operator_changes(self, work: Work) -> None:
        """Changes operators made between steps: the step budget, adapters, prefix cache."""
        if work.step_tokens is not None and work.step_tokens != self.step_tokens:
            self.step_tokens = work.step_tokens  # an operator's live change (bf_policy)
            self.engine.set_step_tokens(work.step_tokens)
        if self._loras.pending:  # an operator's adapter loaded or unloaded (bf_load_lora)
            self._lora_changes()
        if self._reset_prefix:  # an operator's bf_reset_prefix_cache
            self._reset_prefix = False
            self._empty_prefix_cache()

    def _apply_work(self, work: Work) -> list[StepEvent]:
        """What the loop decided: requests stopped, preempted (parked) and admitted; then
        those whose constraints compiled start. The events of those it ended."""
        events: list[StepEvent] = []
        for key, reason in work.stop:
            r = self._reqs.get(key)
            if r is not None:
                self._end(r, reason)
                events += self._finish(r, stream=reason != LOST)
        for key in work.preempt:
            r = self._reqs.get(key)
            if r is not None and not r.parked:
                events.append(self._park(r))
        for key, seqs in work.preempt_seqs:
            r = self._reqs.get(key)
            if r is not None and not r.parked:
                events += self._park_seqs(r, seqs)
        for key, seqs, lane in work.resume:
            r = self._reqs.get(key)
            if r is not None and not r.parked:
                self._resume_seqs(r, seqs, lane)
        lanes = work.lanes or (0,) * len(work.admit)
        for (key, prep), lane in zip(work.admit, lanes, strict=True):
            if prep.payload.lora and key not in self._reqs and not self._lora_live(prep):
                events.append(self._built(Failed(key, f"lora adapter {prep.payload.lora_name!r} "
                                                 "was unloaded", ErrorCode.INVALID_REQUEST)))  # fmt: skip
                continue
            if (answered := self._admit(key, prep, lane)) is not None:
                events += self._finish(answered)
        if self._compiling:
            self._compiled(events)
        return events

    def _read_rows(
        self, outputs: list[Output], produced: dict[str, int]
    ) -> tuple[dict[str, GenReq], int]:
        """The engine's outputs, per row, into their sequences' texts (``produced``: the
        tokens each request took). The requests touched, and the prompt tokens prefilled
        by the sequences whose prefill ended. Per row and step (the deltas wait for it):
        kept lean."""
        prefilled = 0
        touched: dict[str, GenReq] = {}
        by_seq = self._by_seq
        for out in outputs:
            found = by_seq.get(out.sequence)
            if found is None:
                continue  # ended or parked meanwhile
            r, seq = found
            if not seq.text.tokens and out.tokens:  # its prefill ended (its first token)
                prefilled += len(seq.prompt) - self.engine.cached(seq.name)
            if not seq.max_new:  # a prompt to score, and nothing to generate
                if out.tokens or out.finished:  # scored: the token its prefill took is dropped
                    seq.finish = "length"
                    if not out.finished:
                        self.engine.cancel([seq.name])
                    by_seq.pop(seq.name, None)
                    touched[r.key] = r
                continue
            self._take_tokens(r, seq, out, produced)
            if seq.finish is not None:
                by_seq.pop(seq.name, None)
            touched[r.key] = r
        return touched, prefilled

    def _take_tokens(self, r: GenReq, seq: GenSeq, out: Output, produced: dict[str, int]) -> None:
        """A generating row's new tokens, up to a stop token or stop string (``seq.finish``
        set where it ended, with vLLM's ``stop_reason``)."""
        text = seq.text
        new = out.tokens[len(text.tokens) - seq.base :]
        stop_ids = r.spec.stop_ids
        ended = False
        if stop_ids:
            for k, t in enumerate(new):
                if t in stop_ids:  # kept, and nothing after it
                    new, ended = new[: k + 1], True
                    break
        if text.stop and len(new) > 1:  # (speculation) no token after a stop string's
            for k, t in enumerate(new):
                text.extend((t,))
                if text.stopped_at is not None:
                    new = new[: k + 1]
                    break
        else:
            text.extend(new)
        if new:
            produced[r.key] = produced.get(r.key, 0) + len(new)
        if text.stopped_at is not None or ended:
            seq.finish = "stop"
            # vLLM's: a stop string, else the stop token (an end-of-sequence one: none)
            if text.stopped_at is not None:
                seq.stop_reason = text.stop_string
            elif seq.sampling.ignore_eos or new[-1] not in self.eos:
                seq.stop_reason = new[-1]
            self.engine.cancel([seq.name])
        elif out.finished:
            eos = bool(text.tokens) and text.tokens[-1] in self.eos
            seq.finish = "stop" if eos and not seq.sampling.ignore_eos else "length"

    def _touched_events(self, touched: dict[str, GenReq]) -> list[StepEvent]:
        """The events of the requests the step gave tokens: their end, else their deltas."""
        events: list[StepEvent] = []
        for r in touched.values():
            if r.done:
                events += self._finish(r)
            elif r.spec.stream:
                events += self._deltas(r)
        return events

    def _reported(self, report: StepReport, events: list[StepEvent], prefilled: int) -> StepReport:
        """The step's report finished: its events, prefill, constraints; its progress
        left to fill once its deltas are streamed."""
        report.events = events
        report.prefilled = prefilled
        report.compiling = len(self._compiling)
        report.compiling_sequences = self._compiling_sequences()
        if not isinstance(self._grammars, str) and self._grammars.took:
            took = self._grammars.took
            report.compiled_s = tuple(took.popleft() for _ in range(len(took)))
        # after the deltas: the device thread streams them first, then settles this
        report.deferred = lambda: self._fill_progress(report)
        self._unsettled = report
        return report
