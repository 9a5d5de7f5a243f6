"""What a text-generation request reports: its streamed deltas (:class:`~..runner.Partial`),
its result (:class:`~..runner.Final`, one ``Generation`` map per output, log-probabilities,
token ids and strings, the split into reasoning, content and tool calls), where it stands
(:class:`~..runner.Progress`), and the decodes its texts are made with.

Runs on the device thread, per step for the requests that produced tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from ..generation.detok import Decode
from ..generation.sampling import Logprob
from ..runner import DONE, Final, Partial, Progress, StepEvent, StepReport, progress
from .gen_state import ALL_SPECIAL, GenReq, GenSeq, RunnerState

E = TypeVar("E", bound=StepEvent)


class Outputs(RunnerState):
    """Events and progress out of the requests' sequences."""

    def _cancel(self, seqs: list[GenSeq]) -> None:
        """Take sequences out of the engine (those it still has), freeing their blocks."""
        live = [s for s in seqs if self._by_seq.pop(s.name, None) is not None]
        self.engine.cancel(s.name for s in live)

    def _built(self, ev: E) -> E:
        """``ev``, an end (result, failure, preemption) the step built: kept with the step's
        deltas until it returns (:class:`~.gen_state.Unsent`), as its request left the
        runner, or parked, with it."""
        self._unsent.events.append(ev)
        return ev

    def _finish(self, r: GenReq, stream: bool = True) -> list[StepEvent]:
        """A request's last events: its unsent text (streaming), then its Final."""
        tail = self._deltas(r, final=True) if stream and r.spec.stream else []
        return [*tail, self._final(r)]

    def _final(self, r: GenReq) -> Final:
        self._reqs.pop(r.key, None)
        self._cancel(r.seqs)
        outputs: list[dict[str, Any]] = [
            {"text": s.text.final_text, "finish_reason": s.finish or "stop",
             "prompt_tokens": len(s.prompt), "completion_tokens": len(s.text.tokens),
             "cached_tokens": self.engine.cached(s.name)}
            for s in r.seqs
        ]  # fmt: skip
        for s, out in zip(r.seqs, outputs, strict=True):
            if s.stop_reason is not None and s.finish == "stop":
                out["stop_reason"] = s.stop_reason
        if r.beams is not None and r.beams.cached:
            for k, out in enumerate(outputs):
                out["cached_tokens"] = max(r.beams.cached[k // r.spec.n], 0)
        if r.spec.prompt_texts is not None:
            for i, text in enumerate(r.spec.prompt_texts):
                outputs[i * r.spec.n]["prompt_text"] = text
        if r.spec.sampling.logprobs is not None:
            for s, out in zip(r.seqs, outputs, strict=True):
                out["logprobs"] = self._logprobs(self.engine.logprobs(s.name)[: len(s.text.tokens)])
        for s, out in zip(r.seqs, outputs, strict=True):
            if s.split is not None:
                out.update(s.split.result(s.text.final_text))
        if r.spec.token_ids:
            for k, (s, out) in enumerate(zip(r.seqs, outputs, strict=True)):
                out["token_ids"] = list(s.text.tokens)
                if k % r.spec.n == 0:  # the first completion of its prompt
                    out["prompt_token_ids"] = list(s.prompt)
        if r.spec.token_strs:
            for s, out in zip(r.seqs[:: r.spec.n], outputs[:: r.spec.n], strict=True):
                strs = self.tokenizer.convert_ids_to_tokens(list(s.prompt))
                out["prompt_token_strs"] = list(strs)
        for s, out in zip(r.seqs, outputs, strict=True):
            if s.score is not None:
                out["prompt_logprobs"] = self._prompt_logprobs(s)
        for s in r.seqs:
            self.engine.forget(s.name)
        return self._built(Final(r.key, outputs))

    def _prompt_logprobs(self, s: GenSeq) -> list[dict[str, Any] | None]:
        """A scored sequence's prompt log-probabilities; the first token has none (vLLM's
        null)."""
        return [None, *self._logprobs(self.engine.prompt_logprobs(s.name))]

    def _logprobs(self, kept: list[Logprob]) -> list[dict[str, Any]]:
        """A sequence's kept log-probabilities as ``TokenLogprob`` maps, tokens decoded."""
        ids = sorted({t for token, _, top, _, _ in kept for t in (token, *top)})
        texts = dict(zip(ids, self.tokenizer.batch_decode([[i] for i in ids],
                                                          skip_special_tokens=False), strict=True))  # fmt: skip
        return [
            {"token": token, "text": texts[token], "logprob": lp, "rank": rank,
             "top": [{"token": t, "text": texts[t], "logprob": v}
                     for t, v in zip(top, values, strict=True)]}
            for token, lp, top, values, rank in kept
        ]  # fmt: skip

    def _deltas(self, r: GenReq, final: bool = False) -> Sequence[StepEvent]:
        """One Partial per input with tokens not yet sent: their text that can be released
        (all of it when ``final``). Its text may be empty (tokens that show none yet: part of
        a character, the possible start of a stop string; or none at all, such as the
        end-of-sequence token), so a stream's first delta is its first token and the deltas'
        tokens and log-probabilities add up to the result's. A split output's deltas carry
        its ``content`` (and a reasoning one's ``reasoning_content``) piece by piece, which
        add up to the result's (``minicpm5``'s thinking aside, which its stream keeps,
        :attr:`.OutputSplit.streamed`), and each tool call once, in the delta that
        completes it. They are kept till the step returns (:class:`~.gen_state.Unsent`):
        their ``sent`` offsets moved past them."""
        sent = r.sent
        seqs = r.seqs
        if len(seqs) == 1 and sent[0] and seqs[0].split is None:
            spec = r.spec
            if spec.sampling.logprobs is None and not spec.token_ids:
                return self._plain_delta(r, seqs[0], final)
        out: list[Partial] = []
        for i, s in enumerate(seqs):
            text = s.text.delta(final)
            n = len(s.text.tokens)
            split = s.split
            parts = ({} if split is None else
                     split.delta(s.text.released, text, s.text.final_text if final else None))  # fmt: skip
            if text or n > sent[i] or any(parts.values()):
                chunk: dict[str, Any] = {"input": i, "text": text, "tokens": n - sent[i]}
                if not sent[i]:  # its first delta
                    chunk["prompt_tokens"] = len(s.prompt)
                    if r.spec.token_ids:  # each choice's stream begins with them (vLLM's)
                        chunk["prompt_token_ids"] = list(s.prompt)
                    chunk |= self._prompt_echo(r, i)
                if r.spec.sampling.logprobs is not None:
                    chunk["logprobs"] = self._logprobs(self.engine.logprobs(s.name)[sent[i] : n])
                if r.spec.token_ids:
                    chunk["token_ids"] = s.text.tokens[sent[i] : n]
                out.append(Partial(r.key, chunk | parts if parts else chunk))
                sent[i] = n
        if out:
            self._unsent.events += out
        return out

    def _plain_delta(self, r: GenReq, s: GenSeq, final: bool) -> tuple[Partial, ...]:
        """:meth:`_deltas` of most requests, per row and step: one output, past its
        first delta, with text and counts alone (no logprobs, token ids or split)."""
        text = s.text.delta(final)
        n = len(s.text.tokens)
        sent = r.sent
        if not text and n <= sent[0]:
            return ()
        ev = Partial(r.key, {"input": 0, "text": text, "tokens": n - sent[0]})
        sent[0] = n
        self._unsent.events.append(ev)
        return (ev,)

    def _prompt_echo(self, r: GenReq, i: int) -> dict[str, Any]:
        """What the first delta of output ``i`` carries of its prompt for a stream to echo
        it first: the first output of each input, its ``prompt_text`` and ``prompt_logprobs``
        as asked (its prefill is done: it generated)."""
        if i % r.spec.n:
            return {}
        out: dict[str, Any] = {}
        if r.spec.prompt_texts is not None:
            out["prompt_text"] = r.spec.prompt_texts[i // r.spec.n]
        s = r.seqs[i]
        if s.score is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(s)
        return out

    def _progress(self, r: GenReq) -> Progress:
        if r.beams is not None:
            ctx, left = r.beams.contexts()
            return Progress(ctx, (0,) * len(ctx), left)
        if len(r.seqs) == 1:  # most requests: per request and step, kept lean (progress())
            s = r.seqs[0]
            if s.finish is not None:
                return DONE
            context, prefill = self._seq_progress(s)
            return progress((context,), (prefill,), s.max_new - len(s.text.tokens))
        live = [s for s in r.seqs if s.finish is None]  # (those parked alone: waiting)
        ids = tuple(i for i, s in enumerate(r.seqs) if s.finish is None and not s.parked)
        each = [self._seq_progress(r.seqs[i]) for i in ids]
        left = max((s.max_new - len(s.text.tokens) for s in live), default=0)
        return Progress(tuple(c for c, _ in each), tuple(p for _, p in each), left, ids)

    def _seq_progress(self, s: GenSeq) -> tuple[int, int]:
        """An unfinished sequence's tokens in the KV cache and prompt tokens to prefill."""
        st = self.engine.state(s.name)
        if st is None:  # queued this step, not yet in the engine
            return 0, len(s.prompt) + len(s.text.tokens)
        return st.context, st.prefill_left

    def _fill_progress(self, report: StepReport) -> None:
        """Every running request's progress (the step's deferred part, after its deltas).
        Per running request and step: a lone sequence in the engine, the common case, is
        done here in line (as :meth:`_progress` would)."""
        out, state, of = report.progress, self.engine.state, self._progress
        for key, r in self._reqs.items():
            if r.parked:
                continue
            seqs = r.seqs
            if len(seqs) == 1 and r.beams is None:
                s = seqs[0]
                if s.finish is None and (st := state(s.name)) is not None:
                    left = s.max_new - len(s.text.tokens)
                    out[key] = progress((st.context,), (st.prefill_left,), left)
                    continue
            out[key] = of(r)

    def _marked(self, markers: tuple[str, ...]) -> Decode:
        """The decode for texts that parsers read for ``markers`` (see :meth:`_keeping`)."""
        if not markers:
            return self._decode
        if markers not in self._decodes:
            self._decodes[markers] = self._keeping(markers) or self._decode
        return self._decodes[markers]

    def _keeping(self, markers: Sequence[str]) -> Decode | None:
        """A decode that keeps those of ``markers`` this tokenizer makes special tokens
        (and skips the other special tokens; :data:`ALL_SPECIAL`: keeps all but the
        end-of-sequence ones); None where none of them is one."""
        tok = self.tokenizer
        special = set(tok.all_special_ids)
        special |= {i for i, t in tok.added_tokens_decoder.items() if t.special}
        if markers == ALL_SPECIAL:  # skip_special_tokens false
            keep = special - set(self.eos)
        else:
            # an end-of-sequence marker (harmony's <|return|>, <|call|>) ends the text
            keep = {i for i in special if tok.convert_ids_to_tokens(i) in markers} - set(self.eos)
        if not keep:
            return None
        drop = frozenset(special - keep)
        decode = self._backend_decode or tok.decode

        def decode_keeping(ids: Sequence[int]) -> str:
            text: str = decode([i for i in ids if i not in drop], skip_special_tokens=False)
            return text

        return decode_keeping

    def _decode(self, ids: Sequence[int]) -> str:
        """``ids``' text, special tokens skipped. A lone token's comes from
        :attr:`_one_token` once decoded: a stream's window decodes its last committed
        token alone, per row and step (:class:`~..generation.detok.TextStream`)."""
        if len(ids) == 1:
            one = self._one_token.get(ids[0])
            if one is None:
                one = self._one_token[ids[0]] = self._decode_ids(ids)
            return one
        return self._decode_ids(ids)

    def _decode_ids(self, ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            fast: str = self._backend_decode(ids, skip_special_tokens=True)
            return fast
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text
