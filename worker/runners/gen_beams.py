"""The text-generation runner's beam search glue (``use_beam_search``): a request's
searches (:mod:`..generation.beam`) run as rounds of engine sequences
(:mod:`..generation.beam_rounds`), each round's outputs taken, and the best beams made
the request's outputs.

Runs on the device thread, per step while beam requests run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..generation.beam import BeamSearch, Ending
from ..generation.beam_rounds import BeamRounds
from ..generation.detok import TextStream
from ..generation.engine import Output
from ..runner import StepEvent
from .gen_outputs import Outputs
from .gen_state import GenReq, GenSeq, GenSpec


class Beams(Outputs):
    """Beam requests' rounds in the engine."""

    if TYPE_CHECKING:  # defined by .gen_requests.Requests, built on this

        def _start(self, r: GenReq, lane: int) -> None: ...

    def _beam_rounds(self, key: str, spec: GenSpec) -> BeamRounds:
        """A beam request's searches, one per prompt, before their first round."""
        ending = self._ending(spec)
        eos = frozenset() if spec.sampling.ignore_eos else frozenset(self.eos)
        searches = [BeamSearch(len(p), spec.n, m, spec.length_penalty, eos, ending)
                    for p, m in zip(spec.prompts, spec.max_new_tokens, strict=True)]  # fmt: skip
        return BeamRounds(key, spec.prompts, searches, spec.cache_salt, spec.lora,
                          temperature=spec.sampling.temperature, seed=spec.sampling.seed)  # fmt: skip

    def _ending(self, spec: GenSpec) -> Ending:
        """What ends a beam, as it ends a sampled text: an end-of-sequence token (unless
        ``ignore_eos``), a stop token id, a stop string (looked for in the text of its last
        tokens: an earlier one would have ended it before)."""
        eos = frozenset() if spec.sampling.ignore_eos else frozenset(self.eos)
        stop_ids, stops = spec.stop_ids, spec.stop
        window = 2 * max(map(len, stops)) + 8 if stops else 0
        decode = self._decode

        def ending(tokens: tuple[int, ...]) -> tuple[str, str | int | None] | None:
            last = tokens[-1]
            if last in eos:
                return "stop", None
            if last in stop_ids:
                return "stop", last
            if stops:
                text = decode(tokens[-window:])
                for s in stops:
                    if s in text:
                        return "stop", s
            return None

        return ending

    def _beam_step(
        self, outputs: list[Output], produced: dict[str, int]
    ) -> tuple[list[Output], list[StepEvent], int]:
        """The beam rounds' outputs taken (each search that advanced starts its next round,
        or its request ends); the other outputs, the ended requests' events, and the
        prompt tokens the rounds' sequences prefilled (each round is a prompt of its own,
        as vLLM's beam search makes each an engine request)."""
        rest = []
        advanced: dict[str, GenReq] = {}
        prefilled = 0
        for out in outputs:
            r = self._beam_seqs.pop(out.sequence, None)
            if r is None:
                rest.append(out)
                continue
            if r.beams is None:
                continue
            prefilled += r.beams.prefilled(self.engine, out)
            if r.beams.took(self.engine, out):
                advanced[r.key] = r
                produced[r.key] = produced.get(r.key, 0) + 1
        events: list[StepEvent] = []
        for r in advanced.values():
            assert r.beams is not None
            if r.beams.done:
                self._beam_results(r)
                events += self._finish(r)
            else:
                self._start(r, r.beams.lane)
        return rest, events, prefilled

    def _beam_results(self, r: GenReq) -> None:
        """A beam request's outputs take its best beams (prompt by prompt, best first). A
        beam an end-of-sequence token ended leaves it out (its ``token_ids``, its
        ``completion_tokens``) unless ``include_stop_str_in_output``, as vLLM's beams do.
        Each output's text is built apart first, and all are taken at once: a step that
        raises part-way changes none of them, and the next one takes them again whole
        (:meth:`~.gen_step.Stepping._left_midway`), not a beam's text twice."""
        assert r.beams is not None
        n = r.spec.n
        best = [s.best() for s in r.beams.searches]
        eos = frozenset(() if r.spec.sampling.ignore_eos or r.spec.keep_stop else self.eos)
        taken: list[tuple[GenSeq, TextStream, str, str | int | None]] = []
        for k, seq in enumerate(r.seqs):
            beams = best[k // n]
            if k % n >= len(beams):  # ended before its first round
                taken.append((seq, seq.text, seq.finish or "length", seq.stop_reason))
                continue
            beam = beams[k % n]
            ended = beam.finish == "stop" and beam.stop_reason is None and beam.tokens[-1] in eos
            old = seq.text  # (no token yet: a beam's output is only ever filled here)
            text = TextStream(old.decode, old.stop, old.keep_stop)
            text.extend(list(beam.tokens[:-1] if ended else beam.tokens))
            taken.append((seq, text, beam.finish or "length", beam.stop_reason))
        for seq, text, finish, reason in taken:
            seq.text, seq.finish, seq.stop_reason = text, finish, reason

    def _beam_cancel(self, r: GenReq) -> None:
        """Take a beam request's round out of the engine."""
        assert r.beams is not None
        for name in r.beams.pending:
            self._beam_seqs.pop(name, None)
        r.beams.cancel(self.engine)
