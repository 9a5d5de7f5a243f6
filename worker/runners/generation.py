"""``text-generation``: causal LMs with continuous batching and token streaming.

The loop thread prepares requests (chat template, tokenization, bounds); the device thread
steps its engine (:mod:`..generation.engine`): each step admits what the scheduler
decided, ends or frees what it asked, runs one engine step, and reports per request the
text produced (:class:`Partial`, streaming requests only), the end (:class:`Final`, one
:class:`~batchfleet.schemas.messages.Generation` map per input) and where each running
request stands (:class:`Progress`, for the KV-cache budget).

Options (fleet file, ``options``): ``gguf_file`` (load a GGUF file in ``path``),
``kv_cache_tokens`` (KV cache size, default 16384), ``page_size`` (KV block, default 32),
``step_tokens`` (per-step token budget, default 512), ``max_running`` (sequences per
step, default 64), ``engine`` (``auto``, the default: ``padded`` where every layer
attends to the whole context, else ``paged``: transformers' paged engine, for
sliding-window and hybrid models, which ``padded`` refuses; ``cuda_graphs``,
default false: its steps replayed as CUDA graphs), ``lean_decode``
(default true: the padded engine's steps run Llama-family models without
transformers' module stack, :mod:`..generation.lean_decode`; false: their own forwards),
``kv_cache_dtype`` (``auto``, the default: the model's dtype; ``bfloat16``, padded
engine: keys and values kept in bfloat16, half the memory and the bytes the decode
attention reads; vLLM's ``--kv-cache-dtype``),
``matmul_precision`` (``highest``, the default; ``high``: TF32 on CUDA; ``medium``: a
float32 model's linear layers multiply in bfloat16 where the device does so natively,
:mod:`..precision`; the draft model's too),
``prefix_cache_tokens`` (padded engine, default ``kv_cache_tokens / 8``, 0: off; the
keys and values of recent prompts' leading blocks of ``page_size`` tokens kept, up to
this many tokens, so a prompt that begins like one of them prefills only the rest:
:mod:`..generation.prefix_cache`; memory beyond ``kv_cache_tokens``),
``max_new_tokens`` (default for requests that set none, 256; the bound is the model's
``limits.max_new_tokens``, checked when the request is read), ``schedule_ahead`` (default
true: the loop plans and queues each step while the one before runs, so the device does
not wait for it between steps; see ``worker/gen_scheduler.py``), ``tool_call_parser``
(``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, ``qwen3_coder``, ``glm45``,
``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``: how ``tool_choice`` ``auto``
reads tool calls out of the text, :mod:`..generation.tools`; unset: such requests are
refused), ``reasoning_parser`` (:mod:`..generation.reasoning`), ``reasoning_config``
(vLLM's ``--reasoning-config``: ``{reasoning_start_str, reasoning_end_str}``, the markers
a ``thinking_token_budget`` counts within and forces the end of, :mod:`..generation.think_budget`;
default: the reasoning parser's tags), ``compile_threads``
(default 1: threads that compile a constraint not compiled yet while the request waits,
admitted, and the others run; 0: compiled when the request is read, on the loop thread;
:mod:`..generation.grammar`), ``lora_adapters`` (``{name: path}``: PEFT LoRA adapters of
this model, loaded at startup, that a request names in its ``lora``; either engine, any
model family; :mod:`..generation.lora`), ``max_lora_rank`` (default 64, at
most 512: a higher-rank adapter is refused), ``max_loras`` (default 8: adapters loaded at
once, those of ``lora_adapters`` and those loaded while it serves, :meth:`load_lora`),
``generation_config`` (vLLM's ``--generation-config``: ``vllm``, the default, no sampling
defaults; ``auto``: those of the model's ``generation_config.json``; a folder: its file's)
and ``override_generation_config`` (a table over them: ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens``), applied to the fields
a request leaves unset, :mod:`..generation.defaults`; the override's ``max_new_tokens``
(a folder's file's) also cuts a request's own, as vLLM's ``override_max_tokens`` does;
``chat_template``, ``default_chat_template_kwargs``, ``trust_request_chat_template`` and
``chat_template_content_format`` (vLLM's flags of those names),
:mod:`..generation.chat_template`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..device import is_out_of_memory, pick_device, pick_dtype
from ..generation.detok import Decode
from ..runner import StepEvent, StepReport, Work
from .gen_engine import EngineSetup
from .gen_info import Info
from .gen_options import Options, flag, seed_option
from .gen_prepare import Preparing
from .gen_setup import Setup
from .gen_state import GenReq, GenSeq, GenSpec, Unsent
from .gen_step import Stepping

if TYPE_CHECKING:
    from ...batching.gen_types import GenPolicy

__all__ = ["GenSpec", "TextGenerationRunner"]

logger = logging.getLogger(__name__)


class TextGenerationRunner(Stepping, Preparing, Info, Setup, EngineSetup, Options):
    """A causal LM served with continuous batching (see the module docstring).

    Its parts, one module each: :mod:`.gen_state` (the state they share),
    :mod:`.gen_setup`, :mod:`.gen_options`, :mod:`.gen_engine` (startup),
    :mod:`.gen_chat`, :mod:`.gen_prepare` (the loop's side),
    :mod:`.gen_step`, :mod:`.gen_requests`, :mod:`.gen_beams`, :mod:`.gen_outputs`,
    :mod:`.gen_failures` (the device's side), :mod:`.gen_controls` and :mod:`.gen_info` (operators')."""

    name = "text-generation"
    continuous = True
    beam_search = True
    """It takes ``use_beam_search`` (published in the model info)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_tokens: int = 512,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Load the tokenizer and the model, read the options, build the engine: in this
        order, so that an option is refused where it was before (the chat template's
        before the weights load; the engine's once the model's config is known)."""
        if path is None:
            raise ValueError("the text-generation runner needs `path`: a model directory")
        opts = dict(options or {})
        self.torch_device = pick_device(device)
        self.device = str(self.torch_device)
        self.dtype = pick_dtype(dtype, self.torch_device)
        self._load_tokenizer(path, opts)
        self._load_model(path, opts)
        cfg = self.model.config.get_text_config()
        self._read_budgets(opts)
        self._read_defaults(path, opts)
        self.default_new_tokens = self._capped(
            int(opts.get("max_new_tokens", self.sampling_defaults.max_new_tokens or 256))
        )
        """What a request that sets no ``max_new_tokens`` generates at most: the option,
        else the generation config's, else 256 (cut to the cap)."""
        self.schedule_ahead = flag(opts.get("schedule_ahead", True), "schedule_ahead")
        """The loop plans each step while the one before runs (``gen_scheduler.py``)."""
        self._read_parsers(opts)
        self._read_formats()
        self._read_limits(cfg, max_tokens)
        self._pick_engine(cfg, opts)
        self.speculative = self._speculative(opts.get("speculative"), opts.get("engine"))
        """Speculative decoding, n-gram or a draft model's (``options.speculative``;
        None: off)."""
        adapters = self._load_loras(opts)
        self._reset_prefix = False
        """An operator emptied the prefix cache (:meth:`reset_prefix_cache`): done before
        the next step."""
        self.seed = seed_option(opts.get("seed"))
        """Seeds the sampling of requests without a seed (vLLM's ``--seed``; None: random)."""
        self.engine = self._make_engine(opts, adapters)
        self._read_think_tokens()
        self._decodes: dict[tuple[str, ...], Decode] = {}
        """How the texts that parsers read are decoded, by the markers they look for
        (kept where this tokenizer makes them special tokens)."""
        self._one_token: dict[int, str] = {}
        """Each token's text decoded alone, special tokens skipped (:meth:`_decode`: at
        most one entry per vocabulary token)."""
        self._grammars = self._make_grammars()
        """Compiles ``structured_outputs`` (a string: why this model cannot take them)."""
        self._reqs: dict[str, GenReq] = {}
        self._compiling: dict[str, tuple[GenReq, int]] = {}
        """Admitted requests waiting for their constraints, and their lanes."""
        self._unsettled: StepReport | None = None
        """The last step's report, until its progress is filled in."""
        self._unsent = Unsent()
        """What the step under way built, until it returns (kept should it raise)."""
        self._by_seq: dict[str, tuple[GenReq, GenSeq]] = {}
        self._beam_seqs: dict[str, GenReq] = {}
        self._restart: list[GenReq] = []
        """Requests a step that raised left part-started: started once the next step's
        engine step freed the names of the sequences it took back (:meth:`_left_midway`)."""
        """The beam searches' round sequences in the engine, and their requests."""
        self._spec_seen: tuple[int, int, tuple[int, ...], int] = (0, 0, (), 0)
        """The engine's speculation counts at the last step's report."""

    # --- the loop's side ---------------------------------------------------------------

    def generation_policy(self, lanes: int, lane_weights: tuple[float, ...],
                          max_starvation_ms: float) -> GenPolicy:  # fmt: skip
        """The scheduler's budgets for this model."""
        from ...batching.gen_types import GenPolicy

        return GenPolicy(
            kv_cache_tokens=self.kv_cache_tokens, page_size=self.page_size,
            step_tokens=self.step_tokens, max_running=self.max_running, lanes=lanes,
            lane_weights=lane_weights, max_starvation_ms=max_starvation_ms,
        )  # fmt: skip

    # --- the device's side -------------------------------------------------------------

    def step(self, work: Work) -> StepReport:
        """One step, in phases (:mod:`.gen_step`): what a step before it that raised left
        unsent, the operators' changes, the loop's work (stops, preemptions, admissions),
        the engine's step (a failure handled here, once its tensors are freed), its rows
        read into their texts, the report. What it builds is the runner's until it returns
        (:class:`~.gen_state.Unsent`): should it raise, the next step hands it over."""
        self._settle_last()
        unsent = self._unsent
        events = self._carried_over(work) if unsent.open else []
        unsent.open = True
        unsent.admitted = frozenset(key for key, _ in work.admit)
        report = self._step(work, events)
        unsent.handed_over()
        return report

    def _step(self, work: Work, events: list[StepEvent]) -> StepReport:
        """The step's phases, after ``events`` (those carried over)."""
        unsent = self._unsent
        produced = unsent.produced
        report = StepReport(produced=produced)
        self._operator_changes(work)
        events += self._apply_work(work)
        failure = ""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if not is_out_of_memory(exc):
                return self._failed_step(exc, events, report)
            failure = f"{type(exc).__name__}: {exc}"
        if failure:  # handled out here, once the failed step's tensors are freed with it
            return self._out_of_memory(failure, events, report)
        if self._restart:  # (a step before raised part-way through their start)
            self._restart_left()
        if self._beam_seqs:
            outputs, beam_events, prefilled = self._beam_step(outputs, produced)
            unsent.prefilled += prefilled
            events += beam_events
        touched, prefilled = self._read_rows(outputs, produced)
        unsent.prefilled += prefilled
        events += self._touched_events(touched)
        if self.speculative is not None:  # (the engine's counts since the last report)
            self._speculated(report)
        return self._reported(report, events, unsent.prefilled)

    def forget_all(self) -> None:
        """Drop every request and empty the engine: the loop crashed and starts over, and
        reads its requests again (as a new worker would), sampled ones with fresh generators.
        Call with the device thread gone."""
        self.engine.forget_all()
        self._reqs.clear()
        self._by_seq.clear()
        self._beam_seqs.clear()
        self._restart.clear()
        self._compiling.clear()
        self._unsettled = None
        self._unsent = Unsent()
