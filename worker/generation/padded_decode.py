"""The padded engine's decode (:mod:`.padded`): one token for every running row.

The rows decode in one forward of transformers' model over the batch's KV buffers: on
CPU the attention reads each row's own length (:mod:`.decode_attention`), elsewhere it
runs over the longest row's columns under a padding mask. With speculative decoding
(:mod:`.speculative`), rows first propose drafts within the step's budget
(:meth:`_Decode._propose`), each verified in a forward of its own after the decode's, and
take those their sampler accepts and one more (:meth:`_Decode._decoded`, which the lean
step, :mod:`.padded_lean`, shares).
"""

from __future__ import annotations

from typing import Any

import torch

from . import decode_attention
from .engine import Output
from .padded_batch import _Batch
from .padded_prefill import _Prefill


class _Decode(_Batch, _Prefill):
    """Decodes, speculative drafts and their verification (module docstring)."""

    def _decoded(self, logits: torch.Tensor, drafts: dict[int, list[int]] | None = None,
                 verified: torch.Tensor | None = None) -> list[Output]:  # fmt: skip
        """Each row's next tokens from its logits: one, or where the row ran ``drafts``
        (by row), those its sampler accepts and one more (``verified``: the drafts'
        logits, row by row in order)."""
        if not drafts:
            picked: list[list[int]] = [[t] for t in self._pick(logits, self._rows)]
        else:
            assert verified is not None
            plain = [i for i in range(len(self._rows)) if i not in drafts]
            picked = [[] for _ in self._rows]
            if plain:
                rows = [self._rows[i] for i in plain]
                for i, t in zip(plain, self._pick(logits[plain], rows), strict=True):
                    picked[i] = [t]
            at = 0
            for i, d in sorted(drafts.items()):
                r = self._rows[i]
                both = torch.cat([logits[i : i + 1], verified[at : at + len(d)]])
                picked[i] = self.sampler.verify(r.name, both, d, r.eos)
                at += len(d)
                self._tally(d, picked[i])
        out = []
        for r, tokens in zip(self._rows, picked, strict=True):
            for t in tokens:
                r.generated.append(t)
                r.finished = t in r.eos or len(r.generated) >= r.max_new
                if r.finished:
                    break
            out.append(Output(r.name, list(r.generated), r.finished))
        return out

    def _tally(self, drafts: list[int], emitted: list[int]) -> None:
        """Count a row's speculation: its drafts, and those accepted, by position."""
        accepted = 0
        while (
            accepted < min(len(drafts), len(emitted) - 1) and emitted[accepted] == drafts[accepted]
        ):
            accepted += 1
        self.drafted[0] += 1
        self.drafted[1] += len(drafts)
        if len(self.accepted) < len(drafts):
            self.accepted += [0] * (len(drafts) - len(self.accepted))
        for j in range(accepted):
            self.accepted[j] += 1

    def _propose(self) -> dict[int, list[int]]:
        """Per running row that proposes drafts (by index), its drafts (n-gram or a draft
        model's): at most what it may still generate after this step's token and what
        the batch-size bound allows for the sequences the last step ran (``batch_size``,
        as vLLM V1 sizes the drafts a step's end proposes: :mod:`.spec_bound`; none, and
        no proposer call, where it allows none; those rows are counted in
        ``spec_skipped``), and all of them within what the step's budget leaves after one
        token a row (half of that while sequences wait to prefill, so prefill goes on)."""
        spec = self.speculative
        if spec is None or not self._rows:
            return {}
        budget = self.step_tokens - len(self._rows)
        if self._waiting:
            budget //= 2
        # a row whose next token is forced (a spent thinking budget) drafts nothing
        asking = [(i, r) for i, r in enumerate(self._rows)
                  if r.max_new - len(r.generated) > 1 and r.name not in self._cancelled
                  and not self.sampler.forcing(r.name)]  # fmt: skip
        most = spec.limit(self.batch_size)
        if most <= 0:
            self.spec_skipped += len(asking)
            return {}
        drafts = spec.propose([(r.name, r.tokens + r.generated,
                                min(most, r.max_new - len(r.generated) - 1))
                               for _, r in asking], budget)  # fmt: skip
        return {i: d for (i, _), d in zip(asking, drafts, strict=True) if d}

    def _decode(self, drafts: dict[str, list[int]]) -> list[Output]:
        """One token for every row (and where a row proposed ``drafts``, by name, their
        verification: a forward of its own after the decode's)."""
        if not self._rows:
            return []
        assert self._cache is not None
        by_row = {i: drafts[r.name] for i, r in enumerate(self._rows) if r.name in drafts}
        positions, lengths = self._prepare_decode(by_row)
        mask = None  # the kernel reads each row's length; transformers builds no mask
        if not self.row_attention:
            width = self._step.width
            mask = torch.arange(width + 1, device=self.device)[None, :] <= positions[:, None]
        ids = torch.tensor([[r.generated[-1]] for r in self._rows], device=self.device)
        extra: dict[str, Any] = {}
        if self.row_attention:
            extra[decode_attention.LENGTHS] = lengths
        with self._lora_rows([r.lora for r in self._rows]):
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions[:, None],
                cache=self._cache, use_cache=True, logits_to_keep=1, **extra,
            ).logits[:, -1]  # fmt: skip
        if not by_row:
            return self._decoded(logits)
        verified = []
        for i, d in sorted(by_row.items()):
            r = self._rows[i]
            at = torch.arange(r.context + 1, r.context + 1 + len(d), device=self.device)
            with self._lora_rows([r.lora]):
                verified.append(self.model(
                    input_ids=torch.tensor([d], device=self.device), position_ids=at[None],
                    cache=self._row_cache(i), use_cache=True, logits_to_keep=0,
                ).logits[0])  # fmt: skip
        return self._decoded(logits, by_row, torch.cat(verified))
