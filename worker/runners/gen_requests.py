"""A text-generation request's life on the device thread: admitted (its sequences and
their output splits made), started in the engine once its constraint is compiled,
preempted (parked, its tokens kept) and resumed, whole or a sequence at a time, and ended.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import replace

from ...schemas.errors import ErrorCode
from ..generation import harmony
from ..generation.blocks import BlocksReasoning
from ..generation.detok import TextStream
from ..generation.grammar import GrammarError
from ..generation.sampling import Sampling
from ..generation.split import OutputSplit
from ..generation.tool_chunks import CallChunks
from ..generation.tools import MARKERS, CallReader
from ..runner import Failed, Preempted, Prepared, StepEvent
from .gen_beams import Beams
from .gen_state import ALL_SPECIAL, COMPILE_WAIT_S, GenReq, GenSeq, GenSpec


class Requests(Beams):
    """Requests admitted, started, parked and ended."""

    def _admit(self, key: str, prep: Prepared, lane: int) -> GenReq | None:
        """Take an admitted request (new, or resumed); a new one with nothing for the
        engine to do is returned, to be answered at once."""
        r = self._reqs.get(key)
        if r is None:
            spec: GenSpec = prep.payload
            n = spec.n
            use = spec.tools
            markers = (
                MARKERS.get(self._calls_parser or "", ()) if use and use.kind == "auto" else ()
            )
            if self._harmony and use is not None:  # harmony calls, whatever the choice
                markers = harmony.TOKENS
            if self._cohere is not None and use is not None:  # and Command's
                markers = self._cohere.tokens
            if self._blocks is not None and use is not None:  # and the blocks'
                markers = self._blocks.tokens
            tags = self._reasoning.tags if spec.reasoning and self._reasoning else ()
            decode = self._marked(markers + tags
                                  if spec.skip_special else ALL_SPECIAL)  # fmt: skip
            # nothing to generate (max_new_tokens 0): only a prompt to score runs, greedily
            # (its token is dropped); the other sequences end now, with no engine work
            seqs = [GenSeq(f"{key}#{i * n + j}", p, m, TextStream(decode, spec.stop, spec.keep_stop),
                         spec.sampling_of(j, i) if m else Sampling(),
                         score=spec.prompt_logprobs if j == 0 else None, split=self._split(spec),
                         finish=None if m or (j == 0 and spec.prompt_logprobs is not None)
                         else "length")
                    for i, (p, m) in enumerate(zip(spec.prompts, spec.max_new_tokens, strict=True))
                    for j in range(n)]  # fmt: skip
            r = GenReq(key, spec, seqs, sent=[0] * len(seqs), compiling=spec.compiling)
            if spec.beam:
                r.beams = self._beam_rounds(key, spec)
            if r.done:
                return r
            self._reqs[key] = r
        r.parked = False
        r.lane = lane
        if r.compiling is not None:  # it starts once its constraint is compiled
            self._compiling[key] = (r, lane)
            return None
        self._start(r, lane)
        return None

    def _split(self, spec: GenSpec) -> OutputSplit | None:
        """A new output's split (None: its text is not split)."""
        use = spec.tools
        if not spec.reasoning and use is None:
            return None
        reasoning = self._reasoning if spec.reasoning else None
        if reasoning is None and self._blocks is not None and use is not None and spec.stream:
            # vLLM's block tool parsers stream the reasoning blocks too (not in a whole
            # result): a stream's deltas, and so its result, carry them as they stream them
            reasoning = BlocksReasoning(self._blocks.name)
        split = OutputSplit(reasoning, spec.thinking, self._harmony, cohere=self._cohere,
                            blocks=self._blocks)  # fmt: skip
        if use is not None:
            split.channels = self._calls_parser == "kimi_k3"  # unwrapped where no split is
            if self._cohere is not None or self._blocks is not None:  # whatever the choice
                use = replace(use, kind="auto", name=None)
            split.calls = CallReader(use, self._calls_parser, spec.tool_types)
            if spec.stream:
                split.chunks = CallChunks(split.calls, use, self._calls_parser, spec.tool_types)
        return split

    def _start(self, r: GenReq, lane: int) -> None:
        """Put a request's unfinished sequences in the engine (those not there yet): all or
        none. Should one raise, those it added, the one that raised included, are taken out
        again (their KV blocks freed), so a step that raises leaves no sequence in the engine
        that its request does not know of, and the request to start whole once the next
        step's engine step freed those names (:meth:`~.gen_step.Stepping._left_midway`)."""
        if r.beams is not None:
            self._start_round(r, lane)
            return
        self._start_seqs(r, self._unstarted(r), lane)

    def _unstarted(self, r: GenReq) -> list[GenSeq]:
        """A running request's sequences that should run and are not in the engine."""
        return [s for s in r.seqs
                if s.finish is None and not s.parked and s.name not in self._by_seq]  # fmt: skip

    def _start_seqs(self, r: GenReq, seqs: list[GenSeq], lane: int) -> None:
        """Put these sequences of ``r`` in the engine, all or none (see :meth:`_start`)."""
        added: list[str] = []
        try:
            for seq in seqs:
                added.append(seq.name)  # (first: an add that raises may have added it)
                self._start_seq(r, seq, lane)
        except BaseException:
            for name in added:
                self._by_seq.pop(name, None)
            self.engine.cancel(added)
            raise

    def _start_round(self, r: GenReq, lane: int) -> None:
        """A beam search's next round in the engine, all or none (as :meth:`_start`)."""
        assert r.beams is not None
        beams = r.beams
        beams.lane = lane
        beams.start(self.engine)  # (all or none: should it raise, the next step starts it)
        for name in beams.pending:
            self._beam_seqs[name] = r

    def _start_seq(self, r: GenReq, seq: GenSeq, lane: int) -> None:
        """Put one sequence in the engine: its prompt and what it generated so far (a
        resume recomputes them; its sampler's generator goes on where it stopped)."""
        done = len(seq.text.tokens)
        seq.base = done
        # a prompt scored already (its prefill ended: it generated) is not scored again
        self.engine.add(seq.name, list(seq.prompt) + seq.text.tokens, seq.max_new - done,
                        seq.sampling, priority=lane, score=seq.score if not done else None,
                        salt=r.spec.cache_salt, lora=r.spec.lora)  # fmt: skip
        self._by_seq[seq.name] = (r, seq)

    def _compiling_sequences(self) -> int:
        """The unfinished sequences of the requests waiting for their constraints."""
        return sum(sum(s.finish is None for s in r.seqs)
                   for r, _ in self._compiling.values() if not r.parked)  # fmt: skip

    def _compiled(self, events: list[StepEvent]) -> None:
        """Start the requests whose constraints are now compiled (with nothing else to
        run, wait a while for one); a constraint llguidance refused fails its request."""
        pending = [r.compiling for r, _ in self._compiling.values()
                   if r.compiling is not None and not r.parked]  # fmt: skip
        if pending and not self._by_seq:  # the device has nothing else to do
            wait(pending, timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        for key, (r, lane) in list(self._compiling.items()):
            fut = r.compiling
            if self._reqs.get(key) is not r or r.parked or fut is None:
                del self._compiling[key]  # ended, or preempted (admitted again later)
            elif fut.done():
                try:
                    constraint = fut.result()
                except Exception as exc:  # GrammarError: the request's own fault
                    code = ErrorCode.INVALID_REQUEST if isinstance(exc, GrammarError) else (
                        ErrorCode.INFERENCE_FAILED)  # fmt: skip
                    del self._compiling[key]
                    self._reqs.pop(key, None)
                    for seq in r.seqs:
                        self.engine.forget(seq.name)
                    events.append(self._built(Failed(key, str(exc), code)))
                    continue
                for seq in r.seqs:  # (again, the same, where a step raised before it started)
                    seq.sampling = replace(seq.sampling, constraint=constraint)
                # started from here on: the rest of a start a step that raised left part-done
                # is its next step's (_left_midway); before, its entry stays for this to retry
                r.compiling = None
                del self._compiling[key]
                self._start(r, lane)

    def _park(self, r: GenReq) -> Preempted:
        """Free a request's sequences and keep its tokens; it resumes when admitted again."""
        if r.beams is not None:
            self._beam_cancel(r)
            r.parked = True
            contexts, left = r.beams.contexts()
            return self._built(Preempted(r.key, contexts, left))
        live = [(i, s) for i, s in enumerate(r.seqs) if s.finish is None]
        self._cancel([s for _, s in live])
        r.parked = True
        freed = sum(not s.parked for _, s in live)
        for _, s in live:  # (those parked alone before wait with it now)
            s.parked = False
        prompts = tuple(len(s.prompt) + len(s.text.tokens) for _, s in live)
        left = max((s.max_new - len(s.text.tokens) for _, s in live), default=0)
        return self._built(Preempted(r.key, prompts, left, tuple(i for i, _ in live), freed=freed))

    def _park_seqs(self, r: GenReq, seqs: tuple[int, ...]) -> list[Preempted]:
        """Free some of a request's sequences alone, as vLLM preempts a child request of
        ``n > 1``: each keeps its tokens and generator and resumes into its request
        (:meth:`_resume_seqs`); the others run on. One event per sequence freed."""
        out: list[Preempted] = []
        for i in seqs:
            s = r.seqs[i] if 0 <= i < len(r.seqs) else None
            if s is None or s.finish is not None or s.parked:
                continue  # ended meanwhile (its request's final answers it)
            self._cancel([s])
            s.parked = True
            made = len(s.text.tokens)
            out.append(self._built(Preempted(r.key, (len(s.prompt) + made,), s.max_new - made,
                                             (i,), alone=True, freed=1)))  # fmt: skip
        return out

    def _resume_seqs(self, r: GenReq, seqs: tuple[int, ...], lane: int) -> None:
        """Sequences freed alone back into their running request (recomputed from their
        prompt and tokens; a request still waiting for its constraint starts them then).
        All are taken back first, then started together, all or none: should one raise,
        none is left parked (the scheduler counts them all running again) and the next
        step starts them whole (:meth:`~.gen_step.Stepping._left_midway`)."""
        back = [s for i in seqs if 0 <= i < len(r.seqs) and (s := r.seqs[i]).parked]
        for s in back:
            s.parked = False
        if r.compiling is None:
            self._start_seqs(r, [s for s in back if s.finish is None], lane)

    def _end(self, r: GenReq, reason: str) -> None:
        if r.beams is not None:  # the best beams so far, ended for ``reason``
            self._beam_cancel(r)
            r.beams.stop(reason)
            self._beam_results(r)
            return
        live = [s for s in r.seqs if s.finish is None]
        self._cancel(live)
        for s in live:
            s.finish = reason
