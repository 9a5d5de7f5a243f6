"""Speculative decoding with a draft model (vLLM's ``method = "draft_model"``).

A smaller causal LM of the target's vocabulary proposes each decoding row's drafts: it
reads the row's context (prompt and output) and picks its argmax ``k`` times, one token
a forward, as vLLM's draft proposer does (greedy drafts: the engine verifies them as it
verifies n-gram ones, a draft of probability one, so greedy rows emit exactly their
tokens without speculation and sampled rows keep the target's distribution).

Its KV cache is a padded batch like the engine's (:class:`.padded.SlotLayer`): buffer row
``i`` holds one running sequence's keys and values from column 0, and the tokens they are
of are kept beside it. Each proposal first lines a row up with its context: it keeps the
longest prefix of the tokens it holds that the context starts with (the drafts the target
accepted stay; those it rejected, and the last draft's column, are cut off: only the
count changes, later writes go over them), then runs the rest of the context but its last
token row by row (the prompt when the sequence first proposes, in chunks of at most
``chunk`` tokens a step, proposing nothing until it is in; afterwards none, or the last
draft when all were accepted) into a view of its buffer row. Then ``k`` forwards of the
whole buffer, one token a row each at the row's own column under a padding mask, give
every row's drafts at once: the first takes each row's last context token, the next ones
the draft before. Rows that draft fewer (or none: not asked, out of budget) write a stand-in
past what they hold, which is never counted. Tracking the tokens, not counts, keeps a row
right whatever happened since (a sequence added again with other tokens, a stop token
among the drafts). A row leaving moves the last row into its hole (one row copied).

Memory: a row holds at most its context plus ``k - 1`` drafts, and the engine asks for no
more drafts than the row may still generate, so it never holds more tokens than the
target's row may; the buffer has a row per running sequence that proposed (at most
``max_running``, rounded up to 8) and its columns grow by doubling, to the target's longest context
(``max_context``) plus ``k``, and goes when no sequence is left (:meth:`retain`, after
every step). Its bytes per column are the draft's own (layers x 2 x KV heads x head size x
dtype); on CPU only the columns written take memory (:mod:`.reserve`); ``tokens`` counts
those held (the runner's ``info()``: ``draft_kv_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from .padded import SlabLayer, SlotLayer, _Step
from .speculative import DraftConfig, Row


def vocab_size(model: Any) -> int:
    """A causal LM's vocabulary: its config's, else its output embedding's rows."""
    size = getattr(model.config.get_text_config(), "vocab_size", None)
    return int(size) if size else int(model.get_output_embeddings().weight.shape[0])


def load(
    config: DraftConfig, target: Any, chunk: int, max_context: int | None = None
) -> DraftProposer:
    """The draft model of ``config`` on ``target``'s device and dtype, checked: a
    ``ValueError`` where its vocabulary is not the target's (its token ids would mean
    other tokens)."""
    from transformers import AutoModelForCausalLM

    param = next(target.parameters())
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=param.dtype)
    mine, theirs = vocab_size(model), vocab_size(target)
    if mine != theirs:
        raise ValueError(f"options.speculative.model: the draft model's vocabulary has "
                         f"{mine} tokens and the target's {theirs}: they must be the "
                         "same")  # fmt: skip
    return DraftProposer(model.to(param.device).eval(), config, chunk, max_context)


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: nothing was rejected
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


class DraftProposer:
    """Proposes drafts with a draft model (module docstring); one engine's, its thread's."""

    def __init__(self, model: Any, config: DraftConfig, chunk: int = 512,
                 max_context: int | None = None) -> None:  # fmt: skip
        self.model = model
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.chunk = max(1, chunk)
        """The most context tokens a sequence's draft cache takes in one step."""
        self.device = next(model.parameters()).device
        self.max_positions = int(
            getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 1 << 62
        )
        """The draft's longest context: no draft is proposed past it."""
        self.max_context = max_context
        """The target's longest context (None: unknown): the buffer's columns grow to
        no more than it, plus the drafts, unless a row needs them."""
        self._names: list[str] = []
        """Per buffer row, its sequence."""
        self._held: list[list[int]] = []
        """Per buffer row, the tokens whose keys and values it holds, from column 0."""
        self._rows: dict[str, int] = {}
        self._step = _Step()
        self._layers: list[SlotLayer] = []
        self._cache: Cache | None = None
        with torch.inference_mode():  # one token's cache gives the layers' shapes
            probe = Cache(layer_class_to_replicate=SlabLayer)
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device),
                  cache=probe, use_cache=True, logits_to_keep=1)  # fmt: skip
        self._like = [layer.keys for layer in probe.layers]

    @property
    def tokens(self) -> int:
        """Tokens the draft caches hold (their memory: module docstring)."""
        return sum(map(len, self._held))

    def settings(self) -> dict[str, Any]:
        return {"method": "draft_model", "model": self.config.model,
                "num_speculative_tokens": self.num_speculative_tokens}  # fmt: skip

    def retain(self, sequences: Iterable[str]) -> None:
        """Drop the draft caches of every sequence but these (the running ones): the
        buffer's last row moves into each hole; with none left, the buffers go."""
        keep = set(sequences)
        for i in range(len(self._names) - 1, -1, -1):
            if self._names[i] in keep:
                continue
            del self._rows[self._names[i]]
            last = len(self._names) - 1
            if i != last:
                for layer in self._layers:
                    layer.move(last, i, len(self._held[last]))
                self._names[i], self._held[i] = self._names[last], self._held[last]
                self._rows[self._names[i]] = i
            self._names.pop()
            self._held.pop()
        if not self._names:
            self._layers, self._cache = [], None

    def propose(self, rows: Sequence[Row], budget: int) -> list[list[int]]:
        """Per row, up to its limit (and ``num_speculative_tokens``) greedy drafts to
        follow its context, the earlier rows first while ``budget`` lasts (none for a row
        whose prompt is still going into its draft cache, or past the draft's longest
        context): each row's cache lined up with its context, then ``k`` forwards of all
        the buffer's rows (module docstring)."""
        out: list[list[int]] = [[] for _ in rows]
        asking: list[tuple[int, int, Sequence[int], int]] = []
        """(Index in ``rows``, buffer row, context, drafts) of the rows that draft."""
        for n, (name, context, limit) in enumerate(rows):
            k = min(limit, budget, self.num_speculative_tokens,
                    self.max_positions - len(context) + 1)  # fmt: skip
            if k <= 0 or not context:
                continue
            row = self._row(name)
            held = self._held[row]
            # the context's last token always runs: its logits give the first draft
            del held[min(common(held, context), len(context) - 1) :]
            if len(context) - len(held) > self.chunk:
                self._prefill(row, list(context[len(held) : len(held) + self.chunk]))
                continue
            asking.append((n, row, context, k))
            budget -= k
        if not asking:
            return out
        for _, row, context, _ in asking:  # all but the last token, row by row
            self._prefill(row, list(context[len(self._held[row]) : -1]))
        for j in range(max(k for *_, k in asking)):
            feed = {row: (context[-1] if j == 0 else out[n][-1])
                    for n, row, context, k in asking if j < k}  # fmt: skip
            picked = self._decode(feed).argmax(-1).tolist()
            for n, row, _, k in asking:
                if j < k:
                    out[n].append(picked[row])
        return out

    def _row(self, name: str) -> int:
        """The buffer row of sequence ``name`` (a new one, holding nothing, at the end)."""
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._names)
            self._names.append(name)
            self._held.append([])
        return row

    def _reserve(self, width: int) -> None:
        """Room for every row (rows come 8 at a time) and ``width`` columns (they grow by
        doubling, to the target's longest context plus the drafts, unless more are
        needed)."""
        if not self._layers:
            self._layers = [SlotLayer(self._step) for _ in self._like]
            self._cache = Cache(layers=self._layers)
        k = self._layers[0]._k
        rows, cols = (0, 0) if k is None else (int(k.shape[0]), int(k.shape[2]))
        need = len(self._names)
        if need <= rows and width <= cols:
            return
        most = (
            1 << 62 if self.max_context is None else self.max_context + self.num_speculative_tokens
        )
        if need > rows:
            rows = -(-need // 8) * 8
        if width > cols:
            cols = max(width, min(max(2 * cols, 64), most))
        for layer, like in zip(self._layers, self._like, strict=True):
            layer.reserve(like, rows, cols)

    def _prefill(self, row: int, tokens: list[int]) -> None:
        """Run ``tokens`` after what buffer row ``row`` holds, alone (its cache: a view of
        its buffer row, written in place)."""
        if not tokens:
            return
        held = self._held[row]
        start = len(held)
        self._reserve(start + len(tokens))
        layers = []
        for layer in self._layers:
            assert layer._k is not None and layer._v is not None
            layers.append(SlabLayer(layer._k[row : row + 1], layer._v[row : row + 1], start))
        positions = torch.arange(start, start + len(tokens), device=self.device)
        self.model(input_ids=torch.tensor([tokens], device=self.device),
                   position_ids=positions[None], cache=Cache(layers=layers), use_cache=True,
                   logits_to_keep=1)  # fmt: skip
        held += tokens

    def _decode(self, feed: dict[int, int]) -> torch.Tensor:
        """One forward of every buffer row: the rows in ``feed`` take their token after
        what they hold, the others a stand-in past it (never counted as held); each
        row's logits."""
        lengths = [len(h) for h in self._held]
        self._reserve(max(lengths) + 1)
        st = self._step
        positions = torch.tensor(lengths, device=self.device)
        st.rows, st.width, st.positions, st.flat = len(lengths), max(lengths), positions, None
        ids = torch.tensor([[feed.get(row, 0)] for row in range(len(lengths))], device=self.device)
        mask = torch.arange(st.width + 1, device=self.device)[None, :] <= positions[:, None]
        at = positions.clamp(max=self.max_positions - 1)  # (a stand-in at the draft's end)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=at[:, None],
                            cache=self._cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # fmt: skip
        for row, token in feed.items():
            self._held[row].append(token)
        return logits
