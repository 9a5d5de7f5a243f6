"""The padded engine's lean step (:mod:`.padded`): decodes and prefill in one forward.

Where the model has a lean forward (:mod:`.lean_decode`), a step is one forward over the
running rows' decode tokens (and their drafts) and the waiting sequences' prefill chunks
together, so each linear layer runs once over all the step's tokens, each adapter's LoRA
update added on its own tokens (:meth:`_Lean._lora`); a sequence whose prefill ends joins
after that forward, with its first token, and decodes from the next step.
"""

from __future__ import annotations

import numpy as np
import torch

from .engine import Output
from .lean_decode import Chunk, padding_mask
from .lora import Fused, groups
from .padded_decode import _Decode
from .padded_state import _Seq


class _Lean(_Decode):
    """The step as one lean forward (module docstring)."""

    def _fused_step(self) -> list[Output]:
        """One forward for the running rows' decodes and the waiting sequences' prefill
        chunks (:meth:`.LeanDecoder.forward`); the sequences whose prefill ends join the
        batch after it, with their first token, and decode from the next step."""
        assert self.lean is not None
        drafts = self._propose()
        chunks = [(seq, Chunk(tokens, seq.done, seq.cache)) for seq, tokens in self._plan(
            self.step_tokens - len(self._rows) - sum(map(len, drafts.values())), 0)]  # fmt: skip
        rows = len(self._rows)
        padding = None
        verify: list[tuple[_Seq, Chunk]] = []
        if rows:
            positions, lengths = self._prepare_decode(drafts)
            ids = torch.tensor([r.generated[-1] for r in self._rows], device=self.device)
            if not self.row_attention:
                padding = padding_mask(positions, self._step.width)
            verify = [(r, Chunk(drafts[i], r.context + 1, self._row_cache(i)))
                      for i, r in enumerate(self._rows) if i in drafts]  # fmt: skip
        else:
            positions = torch.zeros(0, dtype=torch.long, device=self.device)
            ids, lengths = positions, np.zeros(0, dtype=np.int64)
        if not rows and not chunks:
            return []
        every = [True] * len(verify) + [seq.score is not None for seq, _ in chunks]
        lora = self._lora(verify + chunks) if self.adapters else ()
        logits = self.lean.forward(ids, positions, lengths, self._layers,
                                   [c for _, c in verify + chunks], padding, every, lora)  # fmt: skip
        self._lean_ran = True
        at = rows + sum(map(len, drafts.values()))
        out = self._decoded(logits[:rows], drafts, logits[rows:at]) if rows else []
        ended = []
        last: list[int] = []
        """Per chunk, its last position's row of ``logits``."""
        every = every[len(verify) :]
        for k, (seq, chunk) in enumerate(chunks):
            n = len(chunk.tokens) if every[k] else 1
            if every[k]:
                self._score(seq, logits[at : at + n])
            at += n
            last.append(at - 1)
            seq.done += len(chunk.tokens)
            if seq.done == len(seq.tokens):
                ended.append((seq, k))
        tokens = self._pick(logits[[last[k] for _, k in ended]], [s for s, _ in ended])
        for (seq, k), t in zip(ended, tokens, strict=True):
            self._keep(seq)
            cache = seq.cache
            out.append(self._first(seq, t))
            if not seq.finished:
                self._join(seq)
            twins = self._twins(seq, self.max_running - len(self._rows))
            out += self._share(seq, cache, twins, logits[last[k]], self._join)
        self._leave(lambda r: r.finished)
        return out

    def _lora(self, chunks: list[tuple[_Seq, Chunk]]) -> list[tuple[Fused, torch.Tensor]]:
        """The step's tokens by LoRA adapter (:func:`.lora.groups`): the decode rows',
        then each chunk's."""
        labels = [r.lora for r in self._rows]
        for seq, chunk in chunks:
            labels += [seq.lora] * len(chunk.tokens)
        if not any(labels):
            return []
        return [(a.fused, at) for a, at in groups(labels, self.adapters, self.device)
                if a is not None and a.fused is not None]  # fmt: skip
