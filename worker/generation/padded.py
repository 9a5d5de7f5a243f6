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

With ``kv_cache_dtype`` bfloat16 (vLLM's option; a float32 model), the cache holds keys
and values in bfloat16, half the bytes the decode attention reads and the rows hold: they
are rounded wherever they are written, a prefill's slab included, and widened wherever
they are read, so a sequence's tokens do not depend on what else runs, how its prefill
was chunked, nor whether its prefix came from the prefix cache
(:attr:`.padded_state._State.kv_dtype`).

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

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..device import is_out_of_memory
from . import decode_attention
from .engine import Output, SeqState, seq_state
from .lean_decode import LeanDecoder
from .lora import Adapter, fuse
from .lora_hooks import LoraHooks
from .padded_cache import _Step
from .padded_lean import _Lean
from .padded_state import _Seq
from .prefix_cache import PrefixCache, Salt
from .sampling import Logprob, Sampling, SeededSampler
from .speculative import Proposer

logger = logging.getLogger(__name__)


def _kv_dtype(model: Any, dtype: torch.dtype | None) -> torch.dtype | None:
    """The KV cache's dtype where it is not the model's (None: the model's); a
    ``ValueError`` where the model's attention is not ``sdpa``, the one function that
    reads it widened (:func:`.decode_attention.sdpa`)."""
    if dtype is None or dtype == next(model.parameters()).dtype:
        return None
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", decode_attention.ATTENTION):
        raise ValueError(f"kv_cache_dtype {str(dtype).removeprefix('torch.')} needs the "
                         f"model's attention to be sdpa, and it is {impl!r}")  # fmt: skip
    return dtype


class PaddedEngine(_Lean):
    """One model's continuous batching as one padded batch (module docstring; its
    attributes: :class:`.padded_state._State`; its parts: :class:`.padded_batch._Batch`,
    :class:`.padded_prefill._Prefill`, :class:`.padded_decode._Decode`,
    :class:`.padded_lean._Lean`)."""

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
        seed: int | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.speculative = speculative
        self.drafted = [0, 0]
        self.accepted = []
        self.spec_skipped = 0
        self.batch_size = 0
        self.prefix = prefix_cache
        self.device = next(model.parameters()).device
        self.eos = frozenset(eos_token_ids)
        self.step_tokens = step_tokens
        self.max_running = max_running
        self.max_context = max_context if self.device.type == "cpu" else None
        self.resident_tokens = resident_tokens if self.max_context is not None else None
        self._written = np.zeros(0, dtype=np.int64)
        self.released_bytes = 0
        self.sampler = SeededSampler(self.eos, seed)
        self._waiting = {}
        self._rows = []
        self._running = {}
        self._step = _Step()
        self._layers = []
        self._cache = None
        self._cancelled = set()
        self._added = 0
        self.moves = 0
        self.prefilled = 0
        self.shared = 0
        self.row_attention = decode_attention.usable(model) and row_attention is not False
        self.kv_dtype = _kv_dtype(model, kv_cache_dtype)
        if self.row_attention or self.kv_dtype is not None:  # (sdpa reading the cache's dtype)
            model.set_attn_implementation(decode_attention.ATTENTION)
        self.lean = LeanDecoder.build(model) if lean is not False else None
        if adapters and self.lean is not None:
            laid = [fuse(a, model) for a in adapters]
            if all(a is not None for a in laid):
                adapters = tuple(a for a in laid if a is not None)
            else:
                logger.info("a LoRA adapter targets modules the lean forward does not run: "
                            "this engine uses transformers' forwards")  # fmt: skip
                self.lean = None
        self.adapters = adapters
        self._hooks = LoraHooks(model, adapters) if adapters else None
        self._lean_ran = False
        self._prompt_lps = {}
        self._cached = {}

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
            return seq_state(seq.cached, len(seq.tokens) - seq.cached)
        return seq_state(seq.context, len(seq.tokens) - seq.done)

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
        self.batch_size = 0
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
