"""What the padded engine (:mod:`.padded`) holds: its sequences and its state.

:class:`_Seq` is one sequence, waiting, prefilling or running. :class:`_State` declares
and documents the engine's attributes, which :class:`.padded.PaddedEngine` sets, so that
each part of the engine, a class in a module of its own (:mod:`.padded_batch`,
:mod:`.padded_prefill`, :mod:`.padded_decode`, :mod:`.padded_lean`), reads them typed; it
also holds the two helpers every part uses (:meth:`_State._pick`, :meth:`_State._lora_rows`).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from .lean_decode import LeanDecoder
from .lora import Adapter
from .lora_hooks import LoraHooks
from .padded_cache import SlotLayer, _Step
from .prefix_cache import PrefixCache, Salt
from .sampling import Logprob, SeededSampler
from .speculative import Proposer


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


class _State:
    """The padded engine's attributes (set by :class:`.padded.PaddedEngine`), and the
    helpers each of its parts uses."""

    model: Any
    speculative: Proposer | None
    """Decoding rows propose drafts (n-gram, :mod:`.speculative`, or a draft model's,
    :mod:`.draft`), verified in their decode's forward (None: one token a row and
    step)."""
    drafted: list[int]
    """Speculation so far: the rows that proposed drafts, and the drafts proposed."""
    accepted: list[int]
    """Per draft position (the first draft first), the drafts accepted there so far."""
    spec_skipped: int
    """Rows that would have proposed drafts in a step whose running count the batch-size
    bound allowed none (:mod:`.spec_bound`), so far."""
    batch_size: int
    """The sequences the last step ran (vLLM V1's scheduled requests): its decode rows,
    the sequences its prefill chunks ran for, and their twins waiting on those prefills
    (:meth:`._Prefill._plan`); the batch-size bound's running count for the next step's
    drafts (:mod:`.spec_bound`)."""
    prefix: PrefixCache | None
    """Recent prompts' leading blocks (None: no prefix caching)."""
    device: torch.device
    eos: frozenset[int]
    step_tokens: int
    max_running: int
    max_context: int | None
    """The longest sequence (prompt and generated) it runs, where known and on CPU: the KV
    buffers are then reserved once, ``max_running x max_context``, and take memory only
    where rows write (:mod:`.reserve`); otherwise they grow by doubling."""
    resident_tokens: int | None
    """The KV budget in tokens, for reserved buffers (None: no bound): what their rows
    may hold written before the pages no sequence needs are released (:mod:`.padded`'s
    docstring)."""
    kv_dtype: torch.dtype | None
    """The KV cache's dtype where it is not the model's (``kv_cache_dtype``: bfloat16;
    None: the model's): keys and values are rounded to it wherever they are written (a
    prefill's slab, the batch's rows, so the prefix cache's blocks too) and widened back
    wherever they are read, so a sequence's tokens depend on its own tokens alone, not on
    how its prefill was chunked, nor whether a prefix was cached."""
    _written: np.ndarray
    """Per buffer row, the columns written and not released since (reserved buffers)."""
    released_bytes: int
    """KV memory handed back to the OS so far."""
    sampler: SeededSampler
    _waiting: dict[str, _Seq]
    """Added and not yet running; those with a cache are prefilling."""
    _rows: list[_Seq]
    """The running batch: row ``i`` of the KV buffers is ``_rows[i]``'s."""
    _running: dict[str, _Seq]
    """The same sequences by name."""
    _step: _Step
    _layers: list[SlotLayer]
    _cache: Cache | None
    _cancelled: set[str]
    _added: int
    moves: int
    """Rows moved into holes so far (one row's cache copied each)."""
    prefilled: int
    """Prompt tokens run through the model so far."""
    shared: int
    """Prompt tokens a sequence took from a twin's prefill so far (:meth:`._Prefill._share`)."""
    row_attention: bool
    """Decode attention reads each row's own length (:mod:`.decode_attention`: float32
    on CPU, where numba compiles; None: where usable); otherwise sdpa over the padded
    batch."""
    lean: LeanDecoder | None
    """The step's forward without transformers' module stack (:mod:`.lean_decode`),
    where the model's layers are a known shape (None: where possible); otherwise the
    model's own forwards. Its decode rows attend as ``row_attention`` says. If its
    first step fails (not for memory), it is dropped for good: that step fails as any
    failed step does, and the next ones run transformers' forwards. Not taken where
    an adapter targets a module it does not run (:func:`.lora.fuse`)."""
    adapters: tuple[Adapter | None, ...]
    """The LoRA adapters its sequences may run under (:mod:`.lora`), by label less one
    (None: a label whose adapter was taken away, :meth:`.PaddedEngine.set_adapter`); with a lean
    forward, each laid out for it too (:meth:`.PaddedEngine.fuse_adapter`), in the same memory."""
    _hooks: LoraHooks | None
    """The adapters on transformers' forwards (:mod:`.lora_hooks`)."""
    _lean_ran: bool
    _prompt_lps: dict[str, list[Logprob]]
    """Per sequence that asked, its prompt tokens' log-probabilities so far."""
    _cached: dict[str, int]
    """Per sequence that began with some, its prompt tokens it did not prefill itself
    (:meth:`.PaddedEngine.cached`)."""

    def _lora_rows(self, labels: list[int]) -> AbstractContextManager[None]:
        """A transformers forward's batch rows under these adapters (:mod:`.lora_hooks`;
        none: nothing attached)."""
        if self._hooks is None:
            return contextlib.nullcontext()
        return self._hooks.rows(labels)

    def _pick(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[int]:
        """Each row's next token: the request's own sampler, else greedy."""
        return self.sampler.pick([s.name for s in seqs], logits)
