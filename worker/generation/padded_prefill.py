"""The padded engine's prefill (:mod:`.padded`): waiting sequences into the batch.

Each step plans chunks of the waiting prompts within what its token budget leaves after
the decodes, lane 0 first (:meth:`_Prefill._plan`); a prompt starts from the longest
prefix the prefix cache holds, and leaves its blocks there when its prefill ends.
Sequences with the same tokens, salt and scoring (a request's ``n`` completions) prefill
once: the others take that prefill when it ends, each drawing its own first token from
its last logits (:meth:`_Prefill._share`). A scored prompt keeps its tokens'
log-probabilities chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .engine import Output
from .padded_cache import _cache
from .padded_state import _same, _Seq, _State
from .sampling import logprob_rows


class _Prefill(_State):
    """Prefill chunks, prefix reuse and shared prefills (module docstring)."""

    def _plan(self, budget: int, join_cost: int) -> list[tuple[_Seq, list[int]]]:
        """The prefill chunks that fit ``budget`` tokens (a sequence whose prefill ends
        costs ``join_cost`` more) and the free rows, in prefill order (lane, then
        arrival): each waiting sequence's next tokens, the last one cut where the budget
        ends. Where a lane-0 prompt ends, no lower lane's chunk follows: that step, and
        so its first token, is not held up by prefill work that can wait a step. Sets
        ``batch_size``: the running rows, the planned sequences and their twins
        (:meth:`_count`)."""
        plan: list[tuple[_Seq, list[int]]] = []
        room = self.max_running - len(self._rows)
        urgent = False
        begun: dict[int, _Seq] = {}
        for seq in sorted(self._waiting.values(), key=lambda s: s.order):
            if budget <= 0 or room <= 0 or (urgent and seq.order[0] > 0):
                break
            if seq.cache is None:
                twin = begun.get(seq.key)
                if twin is not None and _same(twin, seq):
                    continue  # takes the twin's prefill when it ends (_share)
                seq.cache = _cache(reserve=len(seq.tokens), dtype=self.kv_dtype)
                if seq.score is None:
                    self._reuse(seq)
            begun.setdefault(seq.key, seq)
            tokens = seq.tokens[seq.done : seq.done + budget]
            plan.append((seq, tokens))
            self.prefilled += len(tokens)
            budget -= len(tokens)
            if seq.done + len(tokens) < len(seq.tokens):
                break  # the budget is spent mid-prompt; it goes on next step
            room -= 1
            budget -= join_cost
            urgent = urgent or seq.order[0] <= 0
        self.batch_size = self._count(plan)
        return plan

    def _count(self, plan: list[tuple[_Seq, list[int]]]) -> int:
        """The sequences a step with this prefill ``plan`` runs, as vLLM V1's scheduler
        counts the requests it schedules (``len(num_scheduled_tokens)``, which sizes the
        drafts proposed at the step's end: :mod:`.spec_bound`): the running rows, the
        planned sequences (a prefill that ends in the step or not), and, up to
        ``max_running``, the waiting twins of a planned sequence, which take its prefill
        when it ends (:meth:`_share`; vLLM schedules each of a request's ``n`` completions
        as a request of its own)."""
        planned = {id(seq) for seq, _ in plan}
        sharing = {seq.key: seq for seq, _ in plan}
        twins = sum(1 for w in self._waiting.values()
                    if w.cache is None and id(w) not in planned
                    and (t := sharing.get(w.key)) is not None and _same(t, w))  # fmt: skip
        ran = len(self._rows) + len(plan)
        return ran + max(0, min(twins, self.max_running - ran))

    def _reuse(self, seq: _Seq) -> None:
        """A sequence about to prefill takes the longest prefix of its tokens that the
        prefix cache holds into its cache; its prefill goes on after it."""
        if self.prefix is None:
            return
        n, kv = self.prefix.lookup(seq.tokens, seq.salt)
        self._cached.setdefault(seq.name, 0 if kv is None else n)  # (not a resumed one's own)
        if kv is None:
            return
        assert seq.cache is not None
        keys, values = kv
        for i in range(keys.shape[0]):
            seq.cache.update(keys[i], values[i], i)
        seq.done = n

    def _score(self, seq: _Seq, logits: torch.Tensor) -> None:
        """A scoring sequence's chunk ran from ``seq.done`` with these logits (one row a
        position): keep the log-probability of each next token it predicts."""
        assert seq.score is not None
        targets = seq.tokens[seq.done + 1 : seq.done + 1 + logits.shape[0]]
        if targets:
            self._prompt_lps[seq.name] += logprob_rows(logits[: len(targets)], targets, seq.score)

    def _keep(self, seq: _Seq) -> None:
        """A sequence's prefill ended: the prefix cache keeps its blocks."""
        if self.prefix is not None and seq.cache is not None:
            self.prefix.store(seq.tokens, [(la.keys, la.values) for la in seq.cache.layers],
                              seq.salt)  # fmt: skip

    def _first(self, seq: _Seq, token: int) -> Output:
        """A sequence whose prefill ended takes its first token and leaves the waiting
        ones (its cache goes too if that token ends it)."""
        del self._waiting[seq.name]
        seq.generated.append(token)
        seq.finished = token in seq.eos or seq.max_new <= 1
        if seq.finished:
            seq.cache = None
        return Output(seq.name, [token], seq.finished)

    def _prefill(self, budget: int) -> tuple[list[_Seq], list[Output]]:
        """Prefill chunks within ``budget`` tokens, one forward each (:meth:`_plan`: a
        sequence that joins also decodes in this step's decode); the sequences whose
        prefill ended (they join the batch) and their first tokens."""
        joined: list[_Seq] = []
        out: list[Output] = []
        for seq, chunk in self._plan(budget, 1):
            ids = torch.tensor([chunk], device=self.device)
            positions = torch.arange(seq.done, seq.done + len(chunk), device=self.device)
            with self._lora_rows([seq.lora]):
                every = self.model(
                    input_ids=ids, position_ids=positions[None], cache=seq.cache,
                    use_cache=True, logits_to_keep=1 if seq.score is None else 0,
                ).logits  # fmt: skip
            if seq.score is not None:
                self._score(seq, every[0])
            logits = every[:, -1]
            seq.done += len(chunk)
            if seq.done < len(seq.tokens):
                break  # the last chunk of the plan
            self._keep(seq)
            cache = seq.cache
            (t,) = self._pick(logits, [seq])
            out.append(self._first(seq, t))
            if not seq.finished:
                joined.append(seq)
            twins = self._twins(seq, self.max_running - len(self._rows) - len(joined))
            out += self._share(seq, cache, twins, logits[0], joined.append)
        return joined, out

    def _twins(self, seq: _Seq, room: int) -> list[_Seq]:
        """Up to ``room`` waiting sequences not yet begun with ``seq``'s tokens (a request's
        ``n`` completions, or the same prompt sent twice): :meth:`_plan` left them for
        ``seq``'s prefill, which they take when it ends (:meth:`_share`)."""
        out: list[_Seq] = []
        for w in self._waiting.values():
            if len(out) >= room:
                break
            if w.key == seq.key and w is not seq and w.cache is None and _same(w, seq):
                out.append(w)
        return out

    def _share(
        self, seq: _Seq, cache: Cache | None, twins: list[_Seq], logits: torch.Tensor, join: Any
    ) -> list[Output]:
        """``twins`` take ``seq``'s ended prefill: its ``cache`` (each row gets its own
        copy), its prompt's scores where they are scored too, and a first token drawn from
        its last ``logits`` by each twin's own sampler."""
        if not twins:
            return []
        out = []
        tokens = self._pick(logits[None].expand(len(twins), -1).clone(), twins)
        for twin, t in zip(twins, tokens, strict=True):
            twin.cache, twin.done = cache, len(twin.tokens)
            if twin.score is not None:  # the same prompt sent twice, both scored
                self._prompt_lps[twin.name] = list(self._prompt_lps.get(seq.name, ()))
            self.shared += twin.done
            self._cached.setdefault(twin.name, twin.done)
            out.append(self._first(twin, t))
            if not twin.finished:
                join(twin)
        return out
