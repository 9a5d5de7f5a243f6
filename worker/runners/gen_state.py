"""The text-generation runner's state: a prepared request (:class:`GenSpec`), its
sequences and requests as the device thread holds them, and :class:`RunnerState`, the
attributes the runner's parts (one module each) share, set by its constructor.

Kept apart so that each part (preparing, outputs, beams, requests, failures, controls,
info) is typed against the same attributes without importing the runner itself.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...schemas.tools import ToolUse
from ..generation.beam_rounds import BeamRounds
from ..generation.detok import Decode, TextStream
from ..generation.grammar import Constraint
from ..generation.sampling import Marker, Sampling
from ..generation.split import OutputSplit
from ..generation.tagged_args import Types
from ..generation.think_budget import ThinkBudget

if TYPE_CHECKING:
    import torch

    from ..generation import blocks as block_formats
    from ..generation import cohere
    from ..generation.chat_template import ChatTemplates
    from ..generation.defaults import SamplingDefaults
    from ..generation.engine import Engine
    from ..generation.grammar import Grammars
    from ..generation.lora_table import AdapterTable
    from ..generation.reasoning import Reasoning
    from ..generation.speculative import DraftConfig, NgramConfig
    from ..generation.think_budget import Markers
    from ..runner import StepEvent, StepReport

COMPILE_WAIT_S = 0.05
"""With nothing else to run, how long a step waits for a constraint being compiled."""
ALL_SPECIAL: tuple[str, ...] = ("<every special token but the end-of-sequence ones>",)
"""The markers of a text that keeps every special token (``skip_special_tokens`` false)."""


@dataclass(frozen=True, slots=True)
class GenSpec:
    """A prepared generation request: prompts as token ids, and how to generate."""

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]
    """Per input: the request's max_new_tokens, cut to what the context leaves (0: none,
    the prompt only; its sequences need the engine only to score their prompts)."""
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end a sequence (the request's ``stop_token_ids``)."""
    n: int = 1
    """Completions per prompt: sequence ``i * n + j`` is prompt ``i``'s ``j``-th."""
    keep_stop: bool = False
    """A stop string that ends a text stays in it (``include_stop_str_in_output``)."""
    prompt_logprobs: int | None = None
    """Keep each prompt's tokens' log-probabilities with this many likeliest tokens (on
    the first completion of each prompt; None: not asked)."""
    tools: ToolUse | None = None
    """How its texts hold tool calls (None: none are read)."""
    reasoning: bool = False
    """Its texts are split into reasoning and answer (a chat to a model with a
    ``reasoning_parser``)."""
    thinking: bool | None = None
    """Where split: whether its texts begin in their reasoning (None: their start tells;
    :func:`~..generation.reasoning.opens`)."""
    tool_types: Types = field(default_factory=dict)
    """Its functions' parameters' types (read by the ``qwen3_coder`` and ``glm45`` parsers)."""
    skip_special: bool = True
    """Special tokens show no text (``skip_special_tokens``; False: all but the
    end-of-sequence tokens show theirs)."""
    token_ids: bool = False
    """Outputs and deltas carry their tokens' ids (``return_token_ids``)."""
    cache_salt: str | None = None
    """Its prompts share cached prefixes only with prompts of the same salt."""
    prompt_texts: tuple[str, ...] | None = None
    """Per input, its prompt's text as the model read it (``return_prompt_text``; None:
    not asked)."""
    token_strs: bool = False
    """Each input's first output carries its prompt's token strings (``return_token_strs``)."""
    compiling: Future[Constraint] | None = None
    """Its constraint, still being compiled (``sampling`` then has none yet; see
    :mod:`..generation.grammar`)."""
    lora: int = 0
    """Its LoRA adapter's label in the runner's table (0: none;
    :mod:`..generation.lora_table`)."""
    lora_name: str | None = None
    beam: bool = False
    """Beam search (``use_beam_search``), ``n`` its width (:mod:`..generation.beam`)."""
    length_penalty: float = 1.0
    budgets: tuple[ThinkBudget, ...] = ()
    """Per prompt, its reasoning's budget (``thinking_token_budget``; empty: none)."""

    def sampling_of(self, j: int, i: int = 0) -> Sampling:
        """Prompt ``i``'s completion ``j``'s sampling: with a seed, its own (``seed + j``);
        with a budget, its prompt's."""
        sampling, seed = self.sampling, self.sampling.seed
        if self.budgets:
            sampling = replace(sampling, think=self.budgets[i])
        if j == 0 or seed is None:
            return sampling
        return replace(sampling, seed=(seed + j) % 2**63)


@dataclass(slots=True)
class GenSeq:
    """One output of a request: its prompt, its text so far, how it is sampled."""

    name: str
    prompt: tuple[int, ...]
    max_new: int
    text: TextStream
    sampling: Sampling
    base: int = 0
    """Tokens generated before the engine last (re)started it (preemption)."""
    finish: str | None = None
    score: int | None = None
    """Its prompt's log-probabilities are kept, with this many likeliest tokens each."""
    split: OutputSplit | None = None
    """Its reasoning, content and tool calls as its text comes (a split output: a chat
    split by the reasoning parser, or a request with ``tools``)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it (vLLM's ``stop_reason``)."""
    parked: bool = False
    """Preempted alone (its request runs on): out of the engine, its tokens and generator
    kept, until it resumes into its request."""


@dataclass(slots=True)
class GenReq:
    """A request on the device thread: its spec and its sequences (``n`` per prompt)."""

    key: str
    spec: GenSpec
    seqs: list[GenSeq]
    parked: bool = False
    sent: list[int] = field(default_factory=list)
    compiling: Future[Constraint] | None = None
    """Its constraint, until compiled: its sequences are not in the engine until then."""
    beams: BeamRounds | None = None
    """A beam search's rounds (its ``seqs`` then take the best beams at the end)."""
    lane: int = 0
    """The lane it was last admitted in: the priority its sequences start with (again, where
    a step that raised left its start part-done)."""

    @property
    def done(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, per row and step
            return seqs[0].finish is not None
        return all(s.finish is not None for s in seqs)


@dataclass(slots=True)
class Unsent:
    """What the step under way built and has not handed over yet (its report returned):
    kept by the runner, not the step, so that a step that raises once its engine ran (a
    runner bug: its sequences' texts and offsets moved on, requests ended or parked) loses
    none of it; the next step hands it over (:meth:`~.gen_step.Stepping._carried_over`)."""

    open: bool = False
    """A step began and has not returned (seen at the next step's start: it raised)."""
    events: list[StepEvent] = field(default_factory=list)
    """Its events, as each was built: deltas (their requests' ``sent`` offsets moved past
    them), results and failures (their requests left the runner), preemptions (their
    requests parked)."""
    admitted: frozenset[str] = frozenset()
    """The requests it admitted: a step that raises fails them (:func:`~..executor.execute`),
    so none of their events is carried over."""
    produced: dict[str, int] = field(default_factory=dict)
    """The tokens it took, per request (the report's ``produced``)."""
    prefilled: int = 0
    """The prompt tokens it prefilled."""

    def handed_over(self) -> None:
        """The step returned its report, which holds all of it: start afresh."""
        self.open = False
        self.events.clear()
        self.admitted = frozenset()
        self.produced = {}  # (the report holds this one)
        self.prefilled = 0


class RunnerState:
    """The attributes of a :class:`~.generation.TextGenerationRunner` its parts read and
    write (set by its constructor, which documents them)."""

    name: str
    tokenizer: Any
    model: Any
    torch_device: torch.device
    device: str
    dtype: torch.dtype
    matmul_precision: str
    templates: ChatTemplates
    eos: list[int]
    vocab_size: int
    context: int
    max_prompt_tokens: int
    page_size: int
    kv_cache_tokens: int
    step_tokens: int
    max_running: int
    compile_threads: int
    prefix_cache_tokens: int
    kv_cache_dtype: torch.dtype
    """What the KV cache holds keys and values in (``options.kv_cache_dtype``: the model's
    dtype, or bfloat16)."""
    max_lora_rank: int
    seed: int | None
    engine_kind: str
    engine: Engine
    speculative: NgramConfig | DraftConfig | None
    sampling_defaults: SamplingDefaults
    new_tokens_cap: int | None
    default_new_tokens: int
    tool_call_parser: str | None
    reasoning_parser: str | None
    _backend_decode: Callable[..., str] | None
    _reasoning: Reasoning | None
    _markers: Markers | None
    _harmony: bool
    _cohere: cohere.Format | None
    _blocks: block_formats.Format | None
    _calls_parser: str | None
    _loras: AdapterTable
    _draining_loras: set[int]
    _reset_prefix: bool
    _think_end: Marker | None
    _think_open: int | None
    _decodes: dict[tuple[str, ...], Decode]
    _one_token: dict[int, str]
    _grammars: Grammars | str
    _reqs: dict[str, GenReq]
    _compiling: dict[str, tuple[GenReq, int]]
    _unsettled: StepReport | None
    _unsent: Unsent
    _restart: list[GenReq]
    _by_seq: dict[str, tuple[GenReq, GenSeq]]
    _beam_seqs: dict[str, GenReq]
    _spec_seen: tuple[int, int, tuple[int, ...], int]
