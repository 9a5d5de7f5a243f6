"""Speculative decoding with a draft model (vLLM's ``method = "draft_model"``).

A smaller causal LM of the target's vocabulary proposes each decoding row's drafts: it
reads the row's context (prompt and output) and picks its argmax ``k`` times, one token
a forward, as vLLM's draft proposer does (greedy drafts: the engine verifies them as it
verifies n-gram ones, a draft of probability one, so greedy rows emit exactly their
tokens without speculation and sampled rows keep the target's distribution).

Its KV cache is a padded batch like the engine's (:class:`.padded_cache.SlotLayer`): buffer row
``i`` holds one running sequence's keys and values from column 0, and the tokens they are
of are kept beside it. Each proposal first lines a row up with its context: it keeps the
longest prefix of the tokens it holds that the context starts with (the drafts the target
accepted stay; those it rejected, and the last draft's column, are cut off: only the
count changes, later writes go over them); the rest of the context (the prompt when the
sequence first proposes, in chunks of at most ``chunk`` tokens a step, proposing nothing
until it is in; afterwards the row's last token, or the last draft and it when all were
accepted) runs in the first of ``k`` forwards of the whole buffer, whose logits at the
context's last token give the first draft; the next forwards take one token a row (the
draft before) at the row's own column, under a padding mask. Rows that draft fewer (or
none: not asked, out of budget) write a stand-in past what they hold, which is never
counted. Tracking the tokens, not counts, keeps a row right whatever happened since (a
sequence added again with other tokens, a stop token among the drafts). A row leaving
moves the last row into its hole (one row copied).

The forwards: for the Llama-family layers :mod:`.lean_decode` knows, its lean forward
(no transformers module stack; the first forward runs the rows' longer rests as prefill
chunks beside the one-token rows, so lining up costs no forward of its own); else
transformers' forwards, which run each row's rest but its last token alone first. Both
give the same drafts (the same argmax; tested). A row with much of its context to run (a
new sequence's prompt) first takes the longest prefix of it that another row holds, by
copying those columns (a request's ``n`` completions, the same prompt sent again): where
that row is running it in this proposal, the copy waits for it and the row proposes
nothing this time, so the prompt goes through the draft once.

Memory: a row holds at most its context plus ``k - 1`` drafts, and the engine asks for no
more drafts than the row may still generate, so it never holds more tokens than the
target's row may; the buffer has a row per running sequence that proposed (at most
``max_running``, rounded up to 8) and its columns grow by doubling, to the target's longest context
(``max_context``) plus ``k``, and goes when no sequence is left (:meth:`retain`, after
every step). Its bytes per column are the draft's own (layers x 2 x KV heads x head size x
dtype); on CPU only the columns written take memory (:mod:`.reserve`); ``tokens`` counts
those held (the runner's ``info()``: ``draft_kv_tokens``). Its products are at the target's
``matmul_precision`` (:mod:`..precision`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from .. import precision
from ..device import is_out_of_memory
from . import decode_attention
from .lean_decode import Chunk, LeanDecoder, padding_mask
from .padded_cache import SlabLayer, SlotLayer, _Step
from .speculative import DraftConfig, Row

logger = logging.getLogger(__name__)


def vocab_size(model: Any) -> int:
    """A causal LM's vocabulary: its config's, else its output embedding's rows."""
    size = getattr(model.config.get_text_config(), "vocab_size", None)
    return int(size) if size else int(model.get_output_embeddings().weight.shape[0])


def load(
    config: DraftConfig, target: Any, chunk: int, max_context: int | None = None,
    lean: bool | None = None, matmul_precision: str = "highest",
) -> DraftProposer:  # fmt: skip
    """The draft model of ``config`` on ``target``'s device and dtype, checked: a
    ``ValueError`` where its vocabulary is not the target's (its token ids would mean
    other tokens); ``lean``: False keeps transformers' forwards (``lean_decode``);
    ``matmul_precision``: the target's (:mod:`..precision`), for its products too."""
    from transformers import AutoModelForCausalLM

    param = next(target.parameters())
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=param.dtype)
    mine, theirs = vocab_size(model), vocab_size(target)
    if mine != theirs:
        raise ValueError(f"options.speculative.model: the draft model's vocabulary has "
                         f"{mine} tokens and the target's {theirs}: they must be the "
                         "same")  # fmt: skip
    most = config.max_model_len
    if most is not None and most > positions(model):
        raise ValueError(f"options.speculative.max_model_len: {most} exceeds the draft "
                         f"model's max_position_embeddings ({positions(model)})")  # fmt: skip
    if most is not None and max_context is not None and most > max_context:
        raise ValueError(f"options.speculative.max_model_len: {most} exceeds the model's "
                         f"context ({max_context})")  # fmt: skip
    model = model.to(param.device).eval()
    precision.apply(model, matmul_precision, param.device, "the draft model")
    return DraftProposer(model, config, chunk, max_context, lean)


def positions(model: Any) -> int:
    """A causal LM's longest context: its ``max_position_embeddings`` (none: no bound)."""
    return int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 1 << 62)


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
                 max_context: int | None = None, lean: bool | None = None,
                 row_attention: bool | None = None) -> None:  # fmt: skip
        self.model = model
        self.lean = LeanDecoder.build(model) if lean is not False else None
        """The forward without transformers' module stack (:mod:`.lean_decode`) where the
        draft's layers are a known shape (None: where possible); else its own forwards."""
        self.row_attention = (self.lean is not None and row_attention is not False
                              and decode_attention.usable(model))  # fmt: skip
        """The lean forward's decode rows attend each over its own length (float32 on
        CPU: :mod:`.decode_attention`); else sdpa over the padded buffer under a mask."""
        self._lean_ran = False
        self.prefilled = 0
        """Context tokens run through the draft so far (its drafts not counted)."""
        self.shared = 0
        """Context tokens a row took from another row's cache so far (:meth:`_fork`)."""
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.chunk = max(1, chunk)
        """The most context tokens a sequence's draft cache takes in one step."""
        self.device = next(model.parameters()).device
        self.max_positions = min(positions(model), config.max_model_len or 1 << 62)
        """The draft's longest context (its ``max_position_embeddings``, or the config's
        ``max_model_len``): no draft is proposed past it."""
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
        most = {} if self.config.max_model_len is None else {"max_model_len": self.max_positions}
        return {"method": "draft_model", "model": self.config.model,
                "num_speculative_tokens": self.num_speculative_tokens, **most,
                **self.config.bound.settings()}  # fmt: skip

    def limit(self, running: int) -> int:
        return self.config.bound.limit(running, self.num_speculative_tokens)

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
                with torch.inference_mode():
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
        with torch.inference_mode():
            return self._propose(rows, budget)

    def _propose(self, rows: Sequence[Row], budget: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        asking: list[tuple[int, int, int]] = []
        """(Index in ``rows``, buffer row, drafts) of the rows that draft."""
        pieces: dict[int, list[int]] = {}
        """Per buffer row that runs context tokens in this call's first forward, those."""
        forks: list[tuple[int, int, int]] = []
        """(Buffer row, source row, columns) to copy once this call's forwards ran."""
        far = self.num_speculative_tokens + 1  # more context to run than a step adds
        for n, (name, context, limit) in enumerate(rows):
            k = min(limit, budget, self.num_speculative_tokens,
                    self.max_positions - len(context) + 1)  # fmt: skip
            if k <= 0 or not context:
                continue
            row = self._row(name)
            held = self._held[row]
            # the context's last token always runs: its logits give the first draft
            del held[min(common(held, context), len(context) - 1) :]
            if len(context) - len(held) > far:  # a prompt: another row may hold it
                source, length = self._source(row, context, pieces)
                if source in pieces and length - len(held) > far:
                    forks.append((row, source, length))
                    continue  # it takes the prefix once the source ran it
                if source not in pieces and length > len(held):
                    self._fork(source, row, length)
            if len(context) - len(held) > self.chunk:
                pieces[row] = list(context[len(held) : len(held) + self.chunk])
                continue
            pieces[row] = list(context[len(held) :])
            asking.append((n, row, k))
            budget -= k
        if pieces:
            self.prefilled += sum(map(len, pieces.values()))
            picked = self._first(pieces, [row for _, row, _ in asking])
            for (n, _, _), token in zip(asking, picked, strict=True):
                out[n].append(token)
        for j in range(1, max((k for *_, k in asking), default=0)):
            feed = {row: out[n][-1] for n, row, k in asking if j < k}
            picked = self._forward(feed, {}).argmax(-1).tolist()
            for n, row, k in asking:
                if j < k:
                    out[n].append(picked[row])
        for row, source, length in forks:
            self._fork(source, row, length)
        return out

    def _source(
        self, row: int, context: Sequence[int], pieces: dict[int, list[int]]
    ) -> tuple[int, int]:
        """The other buffer row holding the longest prefix of ``context`` (but its last
        token), counting what it runs in this call (``pieces``), and that prefix's length
        (``-1, 0``: none)."""
        best, most = -1, 0
        for other, held in enumerate(self._held):
            if other != row:
                length = common(held + pieces[other] if other in pieces else held, context)
                if min(length, len(context) - 1) > most:
                    best, most = other, min(length, len(context) - 1)
        return best, most

    def _fork(self, source: int, row: int, length: int) -> None:
        """Buffer row ``row`` takes the first ``length`` columns ``source`` holds (the
        prompt of a request's ``n`` completions runs once); it keeps the prefix it holds."""
        start = common(self._held[row], self._held[source][:length])
        self._reserve(length)
        for layer in self._layers:
            layer.move(source, row, length, start)
        self._held[row] = self._held[source][:length]
        self.shared += length - start

    def _first(self, pieces: dict[int, list[int]], asking: list[int]) -> list[int]:
        """Run each row's ``pieces`` after what it holds; the first draft of each row in
        ``asking`` (its piece ends with its context's last token). The lean forward runs
        them all at once (a one-token piece as the row's decode token, the others as
        prefill chunks); transformers' forwards prefill the pieces row by row, all but an
        asking row's last token, which the first decode forward takes. Where at least half
        the rows (and four) run two tokens (the last draft and the row's token: all were
        accepted), the lean forward runs the first of them as one decode forward more:
        cheaper than as that many chunks."""
        if self.lean is None:
            ask = set(asking)
            for row, piece in pieces.items():
                self._prefill(row, piece[:-1] if row in ask else piece)
            feed = {row: pieces[row][-1] for row in asking}
            picked = self._forward(feed, {}).argmax(-1).tolist()
            return [picked[row] for row in asking]
        pairs = [row for row in asking if len(pieces[row]) == 2]  # (all drafts accepted)
        if len(pairs) >= 4 and 2 * len(pairs) >= len(self._held):  # costs less than chunks
            self._forward({row: pieces[row][0] for row in pairs}, {})
            pieces = {**pieces, **{row: pieces[row][1:] for row in pairs}}
        feed = {row: pieces[row][0] for row in asking if len(pieces[row]) == 1}
        chunks = {row: piece for row, piece in pieces.items() if row not in feed}
        logits = self._forward(feed, chunks)
        at = {row: logits.shape[0] - len(chunks) + i for i, row in enumerate(chunks)}
        picked = logits[[at.get(row, row) for row in asking]].argmax(-1).tolist()
        return [int(t) for t in picked]

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

    def _view(self, row: int) -> Cache:
        """Buffer row ``row`` as a sequence's own cache: what it holds, written in place
        after it."""
        layers = []
        for layer in self._layers:
            assert layer._k is not None and layer._v is not None
            layers.append(SlabLayer(layer._k[row : row + 1], layer._v[row : row + 1],
                                    len(self._held[row])))  # fmt: skip
        return Cache(layers=layers)

    def _prefill(self, row: int, tokens: list[int]) -> None:
        """Run ``tokens`` after what buffer row ``row`` holds, alone, through transformers'
        forward."""
        if not tokens:
            return
        held = self._held[row]
        self._reserve(len(held) + len(tokens))
        positions = torch.arange(len(held), len(held) + len(tokens), device=self.device)
        self.model(input_ids=torch.tensor([tokens], device=self.device),
                   position_ids=positions[None], cache=self._view(row), use_cache=True,
                   logits_to_keep=1)  # fmt: skip
        held += tokens

    def _forward(self, feed: dict[int, int], chunks: dict[int, list[int]]) -> torch.Tensor:
        """One forward of every buffer row: the rows in ``feed`` take their token after
        what they hold, the others a stand-in past it (never counted as held); with the
        lean forward, ``chunks`` (per row, tokens after what it holds) run in it too (a
        chunk's row writes its stand-in where its chunk then goes; with no ``feed``, the
        chunks alone run). The logits of every buffer row that ran, then of each chunk's
        last token."""
        lengths = [len(h) for h in self._held]
        self._reserve(
            max([n + 1 for n in lengths] + [lengths[r] + len(c) for r, c in chunks.items()])
        )
        st = self._step
        columns = torch.tensor(lengths, device=self.device)
        st.rows, st.width, st.positions, st.flat = len(lengths), max(lengths), columns, None
        ids = torch.tensor([feed.get(row, 0) for row in range(len(lengths))], device=self.device)
        at = columns.clamp(max=self.max_positions - 1)  # (a stand-in at the draft's end)
        if self.lean is None:
            mask = torch.arange(st.width + 1, device=self.device)[None, :] <= columns[:, None]
            logits = self.model(input_ids=ids[:, None], attention_mask=mask,
                                position_ids=at[:, None], cache=self._cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1]  # fmt: skip
        else:
            padding = None if self.row_attention else padding_mask(columns, st.width)
            parts = [Chunk(c, lengths[row], self._view(row)) for row, c in chunks.items()]
            rows = len(lengths) if feed or not chunks else 0
            kept = np.asarray(lengths[:rows], dtype=np.int64) + 1
            logits = self._lean(ids[:rows], at[:rows], kept, parts,
                                None if padding is None else padding[:rows])  # fmt: skip
        for row, token in feed.items():
            self._held[row].append(token)
        for row, c in chunks.items():
            self._held[row] += c
        return logits

    def _lean(self, ids: torch.Tensor, positions: torch.Tensor, lengths: np.ndarray,
              chunks: list[Chunk], padding: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """:meth:`.LeanDecoder.forward`, dropped for transformers' forwards where its first
        run fails (not for memory): that call fails, as the engine's lean step does."""
        assert self.lean is not None
        try:
            logits = self.lean.forward(ids, positions, lengths, self._layers, chunks, padding)
        except Exception as exc:
            if not self._lean_ran and not is_out_of_memory(exc):
                logger.warning("the draft model's lean forward failed on its first run (%s: "
                               "%s); it uses transformers' forwards from now on",
                               type(exc).__name__, exc)  # fmt: skip
                self.lean = None
            raise
        self._lean_ran = True
        return logits
