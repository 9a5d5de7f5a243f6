"""transformers' paged continuous batching, driven one step at a time (``engine = "paged"``).

transformers (>= 5) ships a continuous-batching engine: a paged KV cache, chunked prefill
under a per-step token budget, sequences joining and leaving between steps. Its manager
runs it on a background thread with its own FIFO admission. We use the engine, not the
thread: the worker's scheduler decides which requests join (lanes, deadlines, the KV
budget, preemption — ``batching/generation.py``), and this class adds exactly those and
runs exactly one step per call, so nothing runs that the scheduler did not decide. The
cache is sized by the fleet file (``kv_cache_tokens``); left to its defaults it sizes
itself to the machine's memory.

It calls the engine's step methods (``prepare_next_batch``, ``_generation_step``,
``update_batch``), which are the body of the manager's own loop; ``tests/test_generation.py``
pins their behaviour (greedy tokens equal ``generate``'s).

A sequence may run under one of the engine's LoRA adapters (:mod:`.lora`), beside the base
model's in the same step, and may have its prompt tokens' log-probabilities kept (``score``):
a step whose forward has an adapter's token or a scored position runs it through
:mod:`.paged_step` (hooks on the adapters' modules, a label per token; the scored
positions' logits from the model's own head), eagerly where the engine replays CUDA graphs
(a graph runs no hook); a step with neither runs as before.

Prompts share cached blocks (:mod:`.paged_prefix`: transformers' block sharing, salted by
``cache_salt`` and LoRA adapter) where the model's every layer attends to the whole
context; a scored prompt takes none (a shared block has no logits). A request's ``n``
completions (sequences added with the same tokens, salt and no scoring) prefill once: the
first runs, the others wait until its prefill is done and then take its full blocks,
prefilling only the rest (less than a page). Models with a sliding-window layer share
nothing (its ring buffer is overwritten as a sequence goes on), and twins are not held.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList

from .engine import Output, SeqState, seq_state
from .lora import Adapter
from .lora_hooks import LoraHooks
from .paged_prefix import Salt, SaltedSharing
from .paged_step import Scored, ScoringForward, StepPlan, keep_scores, plan
from .sampling import Logprob, Sampling, SeededSampler


class PagedEngine:
    """One model's continuous-batching engine, stepped by the caller."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        kv_blocks: int,
        page_size: int,
        step_tokens: int,
        max_running: int,
        cuda_graphs: bool = False,
        adapters: tuple[Adapter, ...] = (),
        prefix_sharing: bool = True,
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.adapters: tuple[Adapter | None, ...] = adapters
        """The LoRA adapters its sequences may run under (:mod:`.lora`), by label less one
        (None: a label whose adapter was taken away, :meth:`set_adapter`)."""
        self._hooks = LoraHooks(model, adapters) if adapters else None
        self._labels: dict[str, int] = {}
        """Per sequence under an adapter, its label."""
        self._scored: dict[str, Scored] = {}
        """Per sequence that asked, its prompt tokens' log-probabilities so far."""
        self.sampler = SeededSampler(eos_token_ids, seed)
        generation = GenerationConfig(
            do_sample=False, eos_token_id=eos_token_ids or -1, pad_token_id=pad_token_id,
            max_new_tokens=16,
        )  # fmt: skip
        cb = ContinuousBatchingConfig(
            num_blocks=kv_blocks,
            page_size=page_size,
            max_batch_tokens=step_tokens,
            max_requests_per_batch=max_running,
            allow_block_sharing=prefix_sharing,  # the scheduler counts shared blocks per user
            use_cuda_graph=cuda_graphs,  # replayed steps (CUDA only)
            use_async_batching=False,  # one step per call, its outputs read before the next
            scheduler_type="fifo",
        )
        self.manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=cb
        )
        processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList())
        processors.logits_processor = LogitsProcessorList([self.sampler])
        processors.tensors_required = 1
        processors.supported_keys = dict(self.sampler.supported_kwargs)
        processors.do_processing = True
        self.manager.logit_processor = processors
        self.processor = self.manager._create_batch_processor()
        self.manager.batch_processor = self.processor
        self._outputs: queue.Queue[Any] = self.manager.output_router.output_queue
        self.sharing = SaltedSharing(self.processor.cache)
        self._page = page_size
        self._epochs: dict[int, int] = {}
        """Per adapter label, how many times it was given an adapter (part of the salt:
        a label given another adapter finds none of the former's blocks)."""
        self._twins: dict[str, list[tuple[str, Any]]] = {}
        """Per sequence prefilling for its twins, their names and what :meth:`add` was
        given for them (added once its prefill is done)."""
        self._keys: dict[str, tuple[Any, ...]] = {}
        """Per sequence whose prefill twins may share, what a twin has the same."""

    @property
    def kv_blocks(self) -> int:
        return int(self.processor.cache.num_blocks)

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
        """Queue a sequence; it joins at the next step (its own FIFO: ``priority`` unused).
        ``score``: keep the log-probabilities of its tokens after the first
        (:meth:`prompt_logprobs`), with that many likeliest tokens each (from its start
        again if it was added before); with ``max_new_tokens`` 0 (its prompt only scored) it
        still takes one token, which the runner drops. ``lora``: its adapter, an index into
        ``adapters`` plus one (0: the base model). ``salt``: its request's ``cache_salt``
        (it shares blocks only with sequences of the same salt and adapter)."""
        if lora and not (lora <= len(self.adapters) and self.adapters[lora - 1] is not None):
            raise ValueError(f"LoRA adapter {lora}: the engine does not have it")
        shared: Salt = salt if not lora else (salt, lora, self._epochs.get(lora, 0))
        self.sharing.add(sequence, shared, score is None)
        self._drop_twin(sequence)
        self._release(sequence)
        key = (tuple(tokens), shared)
        args = (tokens, max_new_tokens, sampling, score, lora)
        if score is None and self.sharing.on:
            leader = next((s for s, k in self._keys.items() if k == key), None)
            if leader is not None:  # a twin: waits for the leader's prefill
                self._twins.setdefault(leader, []).append((sequence, args))
                return
            if len(tokens) > self._page:  # a full block to share
                self._keys[sequence] = key
        self._add(sequence, *args)

    def _add(self, sequence: str, tokens: list[int], max_new_tokens: int, sampling: Sampling,
             score: int | None, lora: int) -> None:  # fmt: skip
        self._labels.pop(sequence, None)
        if lora:
            self._labels[sequence] = lora
        self._scored.pop(sequence, None)
        if score is not None:
            self._scored[sequence] = Scored(list(tokens), score)
        self.sampler.add(sequence, sampling, tokens)
        self.manager.add_request(
            tokens,
            request_id=sequence,
            max_new_tokens=max(1, max_new_tokens),
            streaming=True,
            eos_token_id=-1 if sampling.ignore_eos else None,  # -1: no token ends it
        )

    def cancel(self, sequences: Iterable[str]) -> None:
        """Free these sequences (their KV blocks) before the next step."""
        for s in sequences:
            if not self._drop_twin(s):
                self.manager.cancel_request(s)
                self._release(s)

    def _drop_twin(self, sequence: str) -> bool:
        """Whether ``sequence`` was a twin waiting (now dropped)."""
        for twins in self._twins.values():
            for i, (name, _) in enumerate(twins):
                if name == sequence:
                    del twins[i]
                    return True
        return False

    def _release(self, leader: str) -> None:
        """The leader's prefill is done (or it left): its twins are added."""
        self._keys.pop(leader, None)
        for name, args in self._twins.pop(leader, []):
            self._add(name, *args)

    def _release_prefilled(self) -> None:
        for leader in list(self._keys):
            st = self.state(leader)
            if st is None or st.prefill_left == 0:
                self._release(leader)

    def forget(self, sequence: str) -> None:
        """The sequence ended for good (its sampler's generator goes)."""
        self.sampler.forget(sequence)
        self._scored.pop(sequence, None)
        self._labels.pop(sequence, None)
        self.sharing.forget(sequence)

    def logprobs(self, sequence: str) -> list[Logprob]:
        """What a sequence kept of its tokens' log-probabilities (its request asked)."""
        return self.sampler.logprobs(sequence)

    def cached(self, sequence: str) -> int:
        """Prompt tokens a sequence took, when it first began, from shared blocks instead
        of prefilling them (OpenAI's ``cached_tokens``)."""
        return self.sharing.taken.get(sequence, 0)

    def prompt_logprobs(self, sequence: str) -> list[Logprob]:
        """The log-probabilities of a sequence's tokens after its first, as far as its
        prefill has gone (it was added with ``score``; else empty)."""
        s = self._scored.get(sequence)
        return s.kept if s is not None else []

    def forget_all(self) -> None:
        """Drop every sequence and what the sampler keeps of them (the runner starts over)."""
        self.reset()
        self.sampler.clear()
        self._scored.clear()
        self._labels.clear()
        self.sharing.clear()

    def forget_blocks(self) -> int:
        """Between steps: no prompt admitted from now on takes a block shared so far (vLLM's
        ``reset_prefix_cache``); running sequences keep theirs. How many blocks were known."""
        return self.sharing.forget_blocks()

    def fuse_adapter(self, adapter: Adapter) -> Adapter:
        """``adapter`` as it is: this engine has no lean forward; any adapter :mod:`.lora`
        loads is served through hooks."""
        return adapter

    def set_adapter(self, label: int, adapter: Adapter | None) -> None:
        """Between steps (the engine's owner): put ``adapter`` at ``label`` (an index into
        ``adapters`` plus one, past the end: added); None: take that label's away (no
        sequence of it may be left, but cancelled ones)."""
        slots = list(self.adapters) + [None] * max(0, label - len(self.adapters))
        slots[label - 1] = adapter
        self._epochs[label] = self._epochs.get(label, 0) + 1
        while slots and slots[-1] is None:
            slots.pop()
        self.adapters = tuple(slots)
        self._hooks = LoraHooks(self.model, self.adapters) if self.adapters else None

    def step(self) -> list[Output]:
        """Run one step (admissions, cancellations, prefill chunks, one decode per running
        sequence); the outputs it produced."""
        with torch.inference_mode():
            if self.processor.prepare_next_batch():
                io = self.processor.inputs_and_outputs
                extra = None
                if self._labels or self._scored:
                    extra = plan(io.requests_in_batch, io.num_q_tokens, self._labels,
                                 self._scored)  # fmt: skip
                if extra is None:
                    self.manager._generation_step()
                else:
                    self._extended_step(extra)
                self.processor.update_batch()
        if self._keys:
            self._release_prefilled()
        out: list[Output] = []
        while True:
            try:
                o = self._outputs.get_nowait()
            except queue.Empty:
                break
            if o.error:
                raise RuntimeError(f"generation of {o.request_id} failed: {o.error}")
            out.append(Output(o.request_id, list(o.generated_tokens), o.is_finished()))
        return out

    def _extended_step(self, extra: StepPlan) -> None:
        """The step's forward with its adapters' tokens and scored positions
        (:mod:`.paged_step`)."""
        forward = ScoringForward(self.model, extra.positions) if extra.spans else None
        hooks = self._hooks
        adapted = hooks.rows(extra.labels, tokens=True) if hooks and extra.adapted else None
        with self._eager(), adapted or contextlib.nullcontext():
            self.processor._generation_step(forward or self.model)
        if forward is not None:
            assert forward.scored is not None
            keep_scores(extra, forward.scored)

    @contextlib.contextmanager
    def _eager(self) -> Iterator[None]:
        """During the block, the step runs its forward as Python (no CUDA graph replayed
        nor captured: a graph would run no hook, and keep no scored logits)."""
        runner = self.processor.model_runner
        graphs = runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode
        runner.use_cuda_graph_varlen = runner.use_cuda_graph_decode = False
        try:
            yield
        finally:
            runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode = graphs

    def state(self, sequence: str) -> SeqState | None:
        """Where a queued or running sequence stands (None: the engine no longer has it)."""
        sched = self.processor.scheduler
        st = sched.active_requests.get(sequence) or sched.waiting_requests.get(sequence)
        if st is None:
            for twins in self._twins.values():
                for name, args in twins:
                    if name == sequence:  # waits for a twin's prefill
                        return seq_state(0, len(args[0]))
            return None
        left = len(st.remaining_prefill_tokens)
        return seq_state(len(st.initial_tokens) - left + st.generated_len(), left)

    @property
    def step_tokens(self) -> int:
        return int(self.processor.max_batch_tokens)

    def set_step_tokens(self, tokens: int) -> None:
        """Change the per-step token budget (prefill chunks + decodes)."""
        self.processor.max_batch_tokens = tokens

    def reset(self) -> None:
        """Drop every sequence (after a failed step), keeping the samplers' state."""
        self.processor.reset()
        self.processor.cache.evict_cached_blocks()  # what a failed step left is not trusted
        self._twins.clear()  # the runner adds every sequence again
        self._keys.clear()
        for q in (self.manager.input_queue, self.manager.cancel_queue, self._outputs):
            while not q.empty():
                q.get_nowait()
