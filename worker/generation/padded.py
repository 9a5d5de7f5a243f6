"""Our own continuous-batching step loop over transformers' cache classes.

The running sequences form one padded batch. Its KV cache (:class:`SlotLayer`, one per
layer) is a preallocated ``rows x width`` buffer in which row ``i`` holds sequence
``i``'s keys and values from column 0, and each row writes its next token at its own
column; a padding mask hides the columns past each row's length. A step

1. drops cancelled rows: the last row moves into the hole (one row copied),
2. prefills waiting sequences, each in its own growing cache (:class:`SlabLayer`), in
   chunks that fit what the per-step token budget leaves after the decodes, lane 0 first
   (where a lane-0 prompt ends, no lower lane's chunk follows in that step); a finished
   prefill samples the sequence's first token and copies its cache into a new row.
   Sequences with the same tokens (a request's ``n`` completions) prefill once: the
   others wait for it, then each copies its cache and draws its own first token from
   its last logits. With a prefix cache (:mod:`.prefix_cache`), a prompt starts from the
   keys and values of the longest prefix it shares with recent prompts, block by block,
   and prefills only the rest; every finished prefill leaves its blocks there,
3. decodes one token for every row, the new ones too, in one forward pass. On CPU the
   attention reads each row's own length (:mod:`.decode_attention`); elsewhere it runs
   over the first ``longest + 1`` columns under a padding mask (as HF ``generate`` runs
   a static batch),
4. drops the rows that finished.

The decode comes last so that a step's tokens leave the device as soon as they exist,
not after the step's prefill.

Where the model has a lean forward (:mod:`.lean_decode`: Llama-family models, on any
device and dtype), steps 2 and 3 are one forward over the decode rows and the prefill chunks together, so
each linear layer runs once over all the step's tokens; a sequence whose prefill ends
joins after that forward, with its first token, and decodes from the next step.

A sequence may run under one of the engine's LoRA adapters (:mod:`.lora`): each step's
products add each adapter's update on its own tokens (the lean forward's fused products;
otherwise hooks on the model's own modules, :mod:`.lora_hooks`, for the forwards with an
adapter's row), and its prompt shares cached blocks and a prefill only with sequences of
the same adapter (as of the same ``cache_salt``).

Nothing copies the whole batch when sequences join or leave. On CPU, given the longest
context, the buffer is reserved once at ``max_running`` rows of it and takes memory only
where rows write (:mod:`.reserve`); otherwise it grows by doubling (rows up to
``max_running``, columns to the longest context). It is kept. A reserved buffer's rows
keep the pages their longest occupants wrote, so over time they would hold far more than
the KV budget (every row once held a long sequence); given the budget
(``resident_tokens``), when the columns written add up to more, pages no sequence needs
go back to the OS (the free rows', the last first, then past what running sequences can
reach) until a quarter of the budget is free again.

Why not transformers' paged engine (:mod:`.paged`): on CPU it runs attention with a
dense mask over every running sequence's cached tokens, so its cost per token stops
falling at about four sequences (1.6 ms at 16 against 0.18 ms for padded ``generate``,
``python -m bench.generation``). This loop costs what ``generate`` costs per step and
never runs a row nobody waits for. Models with sliding-window or linear-attention
layers need the paged engine: the runner picks it for them (``options.engine`` "auto")
and refuses this one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..device import is_out_of_memory
from . import decode_attention, reserve
from .engine import Output, SeqState
from .lean_decode import Chunk, LeanDecoder, padding_mask
from .lora import Adapter, Fused, fuse, groups
from .lora_hooks import LoraHooks
from .prefix_cache import PrefixCache, Salt
from .sampling import Logprob, Sampling, SeededSampler, logprob_rows
from .speculative import Proposer

logger = logging.getLogger(__name__)


class SlabLayer(DynamicLayer):  # type: ignore[misc]
    """A cache layer writing into a preallocated buffer that grows by doubling, so a
    decode step appends in place instead of copying the whole cache (``DynamicLayer``);
    ``reserve``: columns to allocate at once (a prompt's length: no doubling while it
    prefills). Only the columns written are ever read, so the buffer is not zeroed."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 length: int = 0, reserve: int = 0) -> None:  # fmt: skip
        super().__init__()
        self._k = keys
        self._v = values
        self.reserve = reserve
        if keys is not None and values is not None:
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.device = keys.device
            self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.get_seq_length()
        q = key_states.shape[-2]
        if self._k is None or self._v is None or n + q > self._k.shape[-2]:
            self._grow(key_states, value_states, n + q)
        assert self._k is not None and self._v is not None
        self._k[:, :, n : n + q].copy_(key_states)
        self._v[:, :, n : n + q].copy_(value_states)
        self.keys, self.values = self._k[:, :, : n + q], self._v[:, :, : n + q]
        self.is_initialized = True
        self.device = self._k.device
        return self.keys, self.values

    def _grow(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
        cap = max(need, 2 * (self._k.shape[-2] if self._k is not None else 0), self.reserve, 64)
        n = self.get_seq_length()
        new_k = k.new_empty((k.shape[0], k.shape[1], cap, k.shape[3]))
        new_v = v.new_empty((v.shape[0], v.shape[1], cap, v.shape[3]))
        if n:
            new_k[:, :, :n].copy_(self.keys)
            new_v[:, :, :n].copy_(self.values)
        self._k, self._v = new_k, new_v

    def get_seq_length(self) -> int:
        return 0 if self.keys is None or not self.is_initialized else int(self.keys.shape[-2])


def _cache(layers: list[Any] | None = None, reserve: int = 0) -> Cache:
    """A cache of ``layers``, or one whose :class:`SlabLayer` layers are made as the
    forward reaches them, each reserving ``reserve`` columns."""
    if layers is None:
        return Cache(layer_class_to_replicate=functools.partial(SlabLayer, reserve=reserve))
    return Cache(layers=layers)


@dataclass(slots=True)
class _Step:
    """What every :class:`SlotLayer` of the batch writes in the current decode."""

    rows: int = 0
    width: int = 0
    """The longest row's length before this token: the mask's past length."""
    positions: torch.Tensor | None = None
    """Per row, the column (= position) its new token goes to."""
    flat: torch.Tensor | None = None
    """Per row and key-value head, where its new token goes in a buffer seen as
    ``(rows * heads * capacity) x head_dim``."""
    capacity: int = 0
    """The buffers' columns when ``flat`` was computed."""


class SlotLayer(DynamicLayer):  # type: ignore[misc]
    """One layer of the running batch's KV cache (module docstring): a buffer of
    ``rows x heads x width x head_dim`` that grows by doubling and is kept."""

    def __init__(self, step: _Step) -> None:
        super().__init__()
        self.step = step
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.is_initialized = True

    def reserve(self, like: torch.Tensor, rows: int, width: int) -> None:
        """Room for ``rows`` rows of ``width`` columns (``like``: a ``1 x heads x n x
        head_dim`` cache tensor giving heads, head size, dtype and device)."""
        k = self._k
        if k is not None and k.shape[0] >= rows and k.shape[2] >= width:
            return
        old_rows, old_width = (k.shape[0], k.shape[2]) if k is not None else (0, 0)
        shape = (max(rows, old_rows), like.shape[1], max(width, old_width), like.shape[3])
        new_k, new_v = reserve.zeros(shape, like), reserve.zeros(shape, like)
        if self._k is not None and self._v is not None:
            new_k[:old_rows, :, :old_width] = self._k
            new_v[:old_rows, :, :old_width] = self._v
        self._k, self._v = new_k, new_v

    def place(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row ``row`` takes a prefilled sequence's cache (``1 x heads x n x head_dim``)."""
        assert self._k is not None and self._v is not None
        n = keys.shape[2]
        self._k[row, :, :n] = keys[0]
        self._v[row, :, :n] = values[0]

    @property
    def mapped(self) -> bool:
        """Whether the buffers are :mod:`.reserve` mappings (their pages can be released)."""
        return self._k is not None and reserve.mapped(self._k)

    def release(self, row: int, start: int) -> int:
        """Hand back the pages of row ``row``'s columns from ``start`` on (they read zero
        afterwards); the bytes released."""
        assert self._k is not None and self._v is not None
        width = int(self._k.shape[2])
        return reserve.release(self._k, row, start, width) + reserve.release(
            self._v, row, start, width
        )

    def move(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Row ``dst`` takes row ``src``'s first ``n`` columns (those from ``start``)."""
        assert self._k is not None and self._v is not None
        self._k[dst, :, start:n] = self._k[src, :, start:n]
        self._v[dst, :, start:n] = self._v[src, :, start:n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.step
        assert self._k is not None and self._v is not None and key_states.shape[2] == 1
        rows, heads, capacity, dim = st.rows, self._k.shape[1], self._k.shape[2], self._k.shape[3]
        if st.flat is None or st.capacity != capacity:  # once per step (all layers alike)
            assert st.positions is not None
            head = torch.arange(heads, device=st.positions.device)
            row = torch.arange(rows, device=st.positions.device)
            st.flat = ((row[:, None] * heads + head[None, :]) * capacity
                       + st.positions[:, None]).reshape(-1)  # fmt: skip
            st.capacity = capacity
        # one row copy per (row, head): index_copy_ on a flat view, not advanced indexing
        self._k.view(-1, dim).index_copy_(0, st.flat, key_states.reshape(-1, dim))
        self._v.view(-1, dim).index_copy_(0, st.flat, value_states.reshape(-1, dim))
        self.keys = self._k[:rows, :, : st.width + 1]
        self.values = self._v[:rows, :, : st.width + 1]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.step.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.width + query_length, 0


@dataclass(slots=True)
class _Seq:
    name: str
    tokens: list[int]
    """What to prefill: the prompt, plus what it generated before a preemption."""
    max_new: int
    done: int = 0
    """Tokens of ``tokens`` prefilled so far."""
    cache: Cache | None = None
    """Its own cache while it prefills."""
    order: tuple[int, int] = (0, 0)
    """Prefill order: (priority, arrival)."""
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    key: int = 0
    """A hash of ``tokens``: sequences with the same tokens share one prefill."""
    eos: frozenset[int] = frozenset()
    """The tokens that end it (none: its request ignores end-of-sequence)."""
    cached: int = 0
    """Tokens of ``tokens`` the prefix cache held when it was added: until it begins, they
    are reported as in its cache and only the rest as its prefill (the scheduler's
    prefill backlog), not all of it."""
    score: int | None = None
    """Keep its prompt tokens' log-probabilities, with this many likeliest tokens each
    (None: not asked): its prefill keeps every position's logits, and takes nothing
    from the prefix cache (a cached prefix has no logits)."""
    salt: Salt = None
    """Its request's ``cache_salt``, with its LoRA adapter where it has one: it shares the
    prefix cache's blocks, and a prefill, only with sequences of the same salt."""
    lora: int = 0
    """Its LoRA adapter: an index into the engine's ``adapters``, plus one (0: none)."""

    @property
    def context(self) -> int:
        """Tokens in its cache (the last generated one is not in it yet)."""
        return self.done + max(len(self.generated) - 1, 0)


def _same(a: _Seq, b: _Seq) -> bool:
    """Whether one prefill serves both (the same tokens, salt, adapter and scoring)."""
    return a.tokens == b.tokens and a.salt == b.salt and a.score == b.score


class PaddedEngine:
    """One model's continuous batching as one padded batch (module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: list[int],
        step_tokens: int,
        max_running: int,
        row_attention: bool | None = None,
        lean: bool | None = None,
        max_context: int | None = None,
        resident_tokens: int | None = None,
        prefix_cache: PrefixCache | None = None,
        adapters: tuple[Adapter, ...] = (),
        speculative: Proposer | None = None,
    ) -> None:
        self.model = model
        self.speculative = speculative
        """Decoding rows propose drafts (n-gram, :mod:`.speculative`, or a draft model's,
        :mod:`.draft`), verified in their decode's forward (None: one token a row and
        step)."""
        self.drafted: list[int] = [0, 0]
        """Speculation so far: the rows that proposed drafts, and the drafts proposed."""
        self.accepted: list[int] = []
        """Per draft position (the first draft first), the drafts accepted there so far."""
        self.prefix = prefix_cache
        """Recent prompts' leading blocks (None: no prefix caching)."""
        self.device = next(model.parameters()).device
        self.eos = frozenset(eos_token_ids)
        self.step_tokens = step_tokens
        self.max_running = max_running
        self.max_context = max_context if self.device.type == "cpu" else None
        """The longest sequence (prompt and generated) it runs, where known and on CPU: the KV
        buffers are then reserved once, ``max_running x max_context``, and take memory only
        where rows write (:mod:`.reserve`); otherwise they grow by doubling."""
        self.resident_tokens = resident_tokens if self.max_context is not None else None
        """The KV budget in tokens, for reserved buffers (None: no bound): what their rows
        may hold written before the pages no sequence needs are released (module
        docstring)."""
        self._written = np.zeros(0, dtype=np.int64)
        """Per buffer row, the columns written and not released since (reserved buffers)."""
        self.released_bytes = 0
        """KV memory handed back to the OS so far."""
        self.sampler = SeededSampler(self.eos)
        self._waiting: dict[str, _Seq] = {}
        """Added and not yet running; those with a cache are prefilling."""
        self._rows: list[_Seq] = []
        """The running batch: row ``i`` of the KV buffers is ``_rows[i]``'s."""
        self._running: dict[str, _Seq] = {}
        """The same sequences by name."""
        self._step = _Step()
        self._layers: list[SlotLayer] = []
        self._cache: Cache | None = None
        self._cancelled: set[str] = set()
        self._added = 0
        self.moves = 0
        """Rows moved into holes so far (one row's cache copied each)."""
        self.prefilled = 0
        """Prompt tokens run through the model so far."""
        self.shared = 0
        """Prompt tokens a sequence took from a twin's prefill so far (:meth:`_share`)."""
        self.row_attention = decode_attention.usable(model) and row_attention is not False
        """Decode attention reads each row's own length (:mod:`.decode_attention`: float32
        on CPU, where numba compiles; None: where usable); otherwise sdpa over the padded
        batch."""
        if self.row_attention:
            model.set_attn_implementation(decode_attention.ATTENTION)
        self.lean = LeanDecoder.build(model) if lean is not False else None
        """The step's forward without transformers' module stack (:mod:`.lean_decode`),
        where the model's layers are a known shape (None: where possible); otherwise the
        model's own forwards. Its decode rows attend as ``row_attention`` says. If its
        first step fails (not for memory), it is dropped for good: that step fails as any
        failed step does, and the next ones run transformers' forwards. Not taken where
        an adapter targets a module it does not run (:func:`.lora.fuse`)."""
        if adapters and self.lean is not None:
            laid = [fuse(a, model) for a in adapters]
            if all(a is not None for a in laid):
                adapters = tuple(a for a in laid if a is not None)
            else:
                logger.info("a LoRA adapter targets modules the lean forward does not run: "
                            "this engine uses transformers' forwards")  # fmt: skip
                self.lean = None
        self.adapters: tuple[Adapter | None, ...] = adapters
        """The LoRA adapters its sequences may run under (:mod:`.lora`), by label less one
        (None: a label whose adapter was taken away, :meth:`set_adapter`); with a lean
        forward, each laid out for it too (:meth:`fuse_adapter`), in the same memory."""
        self._hooks = LoraHooks(model, adapters) if adapters else None
        """The adapters on transformers' forwards (:mod:`.lora_hooks`)."""
        self._lean_ran = False
        self._prompt_lps: dict[str, list[Logprob]] = {}
        """Per sequence that asked, its prompt tokens' log-probabilities so far."""
        self._cached: dict[str, int] = {}
        """Per sequence that began with some, its prompt tokens it did not prefill itself
        (:meth:`cached`)."""

    def add(
        self,
        sequence: str,
        tokens: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        priority: int = 0,
        score: int | None = None,
        salt: str | None = None,
        lora: int = 0,
    ) -> None:
        """Queue a sequence; it starts prefilling at the next step, lower ``priority``
        (the request's lane) first, then in the order added. ``score``: keep the
        log-probabilities of its tokens after the first (:meth:`prompt_logprobs`), with
        that many likeliest tokens each (prefilled again from its start if it was); with
        ``max_new_tokens`` 0 (its prompt only scored) it still takes one token, which the
        runner drops. ``salt``: its request's ``cache_salt`` (see :class:`_Seq`); ``lora``:
        its adapter, an index into ``adapters`` plus one (0: the base model)."""
        if lora and not (lora <= len(self.adapters) and self.adapters[lora - 1] is not None):
            raise ValueError(f"LoRA adapter {lora}: the engine does not have it")
        shared: Salt = salt if not lora else (salt, lora)
        self.sampler.add(sequence, sampling, tokens)
        self._cancelled.discard(sequence)
        self._added += 1
        key = hash((tuple(tokens), score, shared))
        if score is not None:
            self._prompt_lps[sequence] = []
        self._waiting[sequence] = _Seq(sequence, list(tokens), max(1, max_new_tokens),
                                       order=(priority, self._added), key=key,
                                       eos=frozenset() if sampling.ignore_eos else self.eos,
                                       score=score, salt=shared, lora=lora)  # fmt: skip
        if self.prefix is not None and score is None:
            self._waiting[sequence].cached = self.prefix.peek(tokens, shared)

    def cancel(self, sequences: Iterable[str]) -> None:
        """Free these sequences before the next step."""
        for s in sequences:
            if self._waiting.pop(s, None) is None and s in self._running:
                self._cancelled.add(s)

    def forget(self, sequence: str) -> None:
        """The sequence ended for good (its sampler's generator goes)."""
        self.sampler.forget(sequence)
        self._prompt_lps.pop(sequence, None)
        self._cached.pop(sequence, None)

    def logprobs(self, sequence: str) -> list[Logprob]:
        """What a sequence kept of its tokens' log-probabilities (its request asked)."""
        return self.sampler.logprobs(sequence)

    def prompt_logprobs(self, sequence: str) -> list[Logprob]:
        """The log-probabilities of a sequence's tokens after its first, as far as its
        prefill has gone (it was added with ``score``; else empty)."""
        return self._prompt_lps.get(sequence, [])

    def cached(self, sequence: str) -> int:
        """Prompt tokens a sequence took, when it first began, from the prefix cache or a
        twin's prefill instead of prefilling them (OpenAI's ``cached_tokens``)."""
        return self._cached.get(sequence, 0)

    def forget_all(self) -> None:
        """Drop every sequence and what the sampler keeps of them (the runner starts over)."""
        self.reset()
        self.sampler.clear()
        self._prompt_lps.clear()
        self._cached.clear()

    def state(self, sequence: str) -> SeqState | None:
        """Where a queued or running sequence stands (None: the engine no longer has it)."""
        seq = self._waiting.get(sequence)
        if seq is None:
            seq = self._running.get(sequence)
            if seq is None or seq.name in self._cancelled:
                return None
        if seq.cache is None and not seq.generated:  # not begun: the cache's part counts
            return SeqState(context=seq.cached, prefill_left=len(seq.tokens) - seq.cached)
        return SeqState(context=seq.context, prefill_left=len(seq.tokens) - seq.done)

    def fuse_adapter(self, adapter: Adapter) -> Adapter:
        """``adapter`` as this engine serves it: laid out for its lean forward as well
        (:func:`.lora.fuse`: one copy of the weights), or as it is where it has none; a
        ``ValueError`` where it targets a module that forward does not run (at startup the
        engine takes transformers' forwards then; while it serves, it does not change).
        Any thread: it reads the model's layers, changes nothing."""
        if self.lean is None or adapter.fused is not None:
            return adapter
        laid = fuse(adapter, self.model)
        if laid is None:
            raise ValueError(f"adapter {adapter.name!r} targets modules the lean forward does "
                             "not run: load it at startup (options.lora_adapters), or serve "
                             "the model with lean_decode false")  # fmt: skip
        return laid

    def set_adapter(self, label: int, adapter: Adapter | None) -> None:
        """Between steps (the engine's owner): put ``adapter`` (as :meth:`fuse_adapter`
        gave it) at ``label`` (an index into ``adapters`` plus one, past the end: added);
        None: take that label's away and let its memory go (no sequence of it may be left,
        but cancelled ones)."""
        slots = list(self.adapters) + [None] * max(0, label - len(self.adapters))
        slots[label - 1] = None if adapter is None else self.fuse_adapter(adapter)
        while slots and slots[-1] is None:
            slots.pop()
        self.adapters = tuple(slots)
        self._hooks = LoraHooks(self.model, self.adapters) if self.adapters else None

    def set_step_tokens(self, tokens: int) -> None:
        """Change the per-step token budget (prefill chunks + decodes)."""
        self.step_tokens = tokens

    def reset(self) -> None:
        """Drop every sequence and the KV buffers (after a failed step), keeping the
        samplers' state."""
        self._waiting.clear()
        self._rows = []
        self._running = {}
        self._layers = []
        self._cache = None
        self._cancelled.clear()
        self._written = np.zeros(0, dtype=np.int64)
        if self.speculative is not None:
            self.speculative.retain(())
        if self.prefix is not None:  # after a failure (out of memory?), hold nothing
            self.prefix.clear()

    @property
    def running(self) -> int:
        return len(self._rows) - len(self._cancelled)

    @property
    def resident(self) -> int:
        """Tokens the KV buffers' rows hold written (reserved buffers; otherwise 0)."""
        return int(self._written.sum())

    @property
    def width(self) -> int:
        """Columns the next decode attends over (the longest running row's, plus one)."""
        return max((r.context for r in self._rows), default=-1) + 1

    def step(self) -> list[Output]:
        """Run one step (module docstring); the outputs it produced, one per sequence."""
        with torch.inference_mode():
            if self._cancelled:
                self._leave(lambda r: r.name in self._cancelled)
                self._cancelled.clear()
            if self.lean is not None:
                outputs = self._lean_step()
            else:
                drafts = {self._rows[i].name: d for i, d in self._propose().items()}
                budget = self.step_tokens - len(self._rows) - sum(map(len, drafts.values()))
                joined, first = self._prefill(budget=budget)
                for seq in joined:
                    self._join(seq)
                out = {o.sequence: o for o in first}
                out.update((o.sequence, o) for o in self._decode(drafts))
                self._leave(lambda r: r.finished)
                outputs = list(out.values())
            self._trim()
            if self.speculative is not None:  # what it keeps of rows that left goes
                self.speculative.retain(self._running)
        return outputs

    # --- the batch ---------------------------------------------------------------------

    def _leave(self, gone: Any) -> None:
        """Rows for which ``gone(row)`` leave; the last row fills each hole."""
        for i in range(len(self._rows) - 1, -1, -1):
            if not gone(self._rows[i]):
                continue
            del self._running[self._rows[i].name]
            last = len(self._rows) - 1
            if i != last:
                n = self._rows[last].context
                for layer in self._layers:
                    layer.move(last, i, n)
                if i < len(self._written):
                    self._written[i] = max(self._written[i], n)
                self._rows[i] = self._rows[last]
                self.moves += 1
            self._rows.pop()

    def _join(self, seq: _Seq) -> None:
        """A prefilled sequence becomes the batch's last row."""
        assert seq.cache is not None
        source = seq.cache.layers
        if not self._layers:
            self._layers = [SlotLayer(self._step) for _ in source]
            self._cache = _cache(self._layers)
        row = len(self._rows)
        cap_rows, cap_width = self._capacity()
        width = seq.context + 1
        if self.max_context is not None:
            rows, width = max(self.max_running, row + 1), max(self.max_context, width)
        else:
            rows = (
                row + 1
                if row < cap_rows
                else max(min(self.max_running, max(8, 2 * cap_rows)), row + 1)
            )
            if width > cap_width:
                width = max(2 * cap_width, 256, width)
        for layer, src in zip(self._layers, source, strict=True):
            layer.reserve(src.keys, rows, width)
            layer.place(row, src.keys[:, :, : seq.context], src.values[:, :, : seq.context])
        if self._layers[0].mapped:
            if len(self._written) < self._capacity()[0]:
                self._written = np.pad(self._written, (0, self._capacity()[0] - len(self._written)))
            self._written[row] = max(self._written[row], seq.context)
        seq.cache = None
        self._rows.append(seq)
        self._running[seq.name] = seq

    def _trim(self) -> None:
        """Where the rows hold more written columns than ``resident_tokens``, release
        pages (module docstring) until a quarter of the budget is free: first the free
        rows', the last first (the batch reaches them last), then those past a running
        sequence's prompt and ``max_new``, most first; then, if still over the budget,
        those past a sequence's context, which it may yet write."""
        limit, written = self.resident_tokens, self._written
        if limit is None or not len(written) or int(written.sum()) <= limit:
            return
        context = np.zeros_like(written)
        reach = np.zeros_like(written)
        n = len(self._rows)
        context[:n] = [r.context for r in self._rows]
        reach[:n] = [r.done + r.max_new for r in self._rows]
        total = int(written.sum())
        for keep, goal in ((np.maximum(context, np.minimum(reach, written)), limit - limit // 4),
                           (context, limit)):  # fmt: skip
            excess = written - keep
            order = sorted(range(len(written)), key=lambda r: (r < n, -r if r >= n else -excess[r]))
            for row in order:
                if total <= goal:
                    break
                if excess[row] <= 0:
                    continue
                for layer in self._layers:
                    self.released_bytes += layer.release(row, int(keep[row]))
                total -= int(excess[row])
                written[row] = keep[row]

    def _capacity(self) -> tuple[int, int]:
        k = self._layers[0]._k if self._layers else None
        return (0, 0) if k is None else (int(k.shape[0]), int(k.shape[2]))

    def _lean_step(self) -> list[Output]:
        """:meth:`_fused_step`, dropping the lean forward where its first step fails."""
        try:
            out = self._fused_step()
        except Exception as exc:
            if not self._lean_ran and not is_out_of_memory(exc):
                logger.warning(
                    "the lean step forward failed on its first step (%s: %s); this engine "
                    "uses transformers' forwards from now on", type(exc).__name__, exc,
                )  # fmt: skip
                self.lean = None
            raise
        return out

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

    def _prepare_decode(self, drafts: dict[int, list[int]]) -> tuple[torch.Tensor, np.ndarray]:
        """Room for every row's next token and its ``drafts`` (by row), and the step's
        write positions set; each row's position and key count (with its new token)."""
        rows = len(self._rows)
        lengths = [r.context for r in self._rows]
        ends = np.asarray(lengths) + 1
        for i, d in drafts.items():
            ends[i] += len(d)
        width = max(lengths)
        if int(ends.max()) > self._capacity()[1]:
            grow_to = max(2 * self._capacity()[1], int(ends.max()))
            for layer in self._layers:
                assert layer._k is not None
                layer.reserve(layer._k[:1], rows, grow_to)
        if len(self._written):
            w = self._written[:rows]
            np.maximum(w, ends, out=w)  # the columns after this write
        positions = torch.tensor(lengths, device=self.device)
        st = self._step
        st.rows, st.width, st.positions, st.flat = rows, width, positions, None
        return positions, np.asarray(lengths, dtype=np.int64) + 1

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
        model's): at most what it may still generate after this step's
        token, and all of them within what the step's budget leaves after one token a
        row (half of that while sequences wait to prefill, so prefill goes on)."""
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
        drafts = spec.propose([(r.name, r.tokens + r.generated, r.max_new - len(r.generated) - 1)
                               for _, r in asking], budget)  # fmt: skip
        return {i: d for (i, _), d in zip(asking, drafts, strict=True) if d}

    def _row_cache(self, row: int) -> Cache:
        """Row ``row``'s KV as a cache for a chunk of drafts after its decode token: a
        view of its buffer row, which the chunk's keys and values are written into."""
        n = self._rows[row].context + 1
        layers = []
        for layer in self._layers:
            assert layer._k is not None and layer._v is not None
            layers.append(SlabLayer(layer._k[row : row + 1], layer._v[row : row + 1], n))
        return _cache(layers)

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

    def _plan(self, budget: int, join_cost: int) -> list[tuple[_Seq, list[int]]]:
        """The prefill chunks that fit ``budget`` tokens (a sequence whose prefill ends
        costs ``join_cost`` more) and the free rows, in prefill order (lane, then
        arrival): each waiting sequence's next tokens, the last one cut where the budget
        ends. Where a lane-0 prompt ends, no lower lane's chunk follows: that step, and
        so its first token, is not held up by prefill work that can wait a step."""
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
                seq.cache = _cache(reserve=len(seq.tokens))
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
        return plan

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

    def _lora_rows(self, labels: list[int]) -> AbstractContextManager[None]:
        """A transformers forward's batch rows under these adapters (:mod:`.lora_hooks`;
        none: nothing attached)."""
        if self._hooks is None:
            return contextlib.nullcontext()
        return self._hooks.rows(labels)

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

    def _pick(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[int]:
        """Each row's next token: the request's own sampler, else greedy."""
        return self.sampler.pick([s.name for s in seqs], logits)
