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

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from ...schemas.errors import ErrorCode
from ...schemas.inputs import TokenPrompt
from ...schemas.messages import ChatMessage, Request, StructuredOutputs
from ...schemas.tools import ToolUse, called
from ..device import is_out_of_memory, pick_device, pick_dtype, release_cached_memory
from ..generation import blocks as block_formats
from ..generation import cohere, defaults, harmony, hy_v4, strict_calls, struct_tag
from ..generation.beam import BeamSearch, Ending
from ..generation.beam_rounds import BeamRounds
from ..generation.chat_template import ChatTemplates, ContentFormat, TemplateRefused
from ..generation.chat_template import content as template_content
from ..generation.detok import Decode, TextStream
from ..generation.engine import Engine, Output
from ..generation.grammar import Constraint, GrammarError, Grammars
from ..generation.lora_table import MAX_LORAS, AdapterTable
from ..generation.reasoning import REASONING_PARSERS, Reasoning, reasoning_for
from ..generation.sampling import Logprob, Marker, Sampling
from ..generation.speculative import DraftConfig, NgramConfig, Proposer, parse
from ..generation.split import OutputSplit
from ..generation.tagged_args import TYPED_ARGS, Types, param_types
from ..generation.think_budget import Markers, ThinkBudget, markers
from ..generation.tool_chunks import CallChunks
from ..generation.tools import ALIASES, MARKERS, PARSERS, CallReader
from ..runner import (
    LOST,
    Failed,
    Final,
    Partial,
    Preempted,
    Prepared,
    PrepareError,
    Progress,
    StepEvent,
    StepReport,
    Work,
)

if TYPE_CHECKING:
    from ...batching.generation import GenPolicy
    from ..generation.lora import Adapter

logger = logging.getLogger(__name__)


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
class _Seq:
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


@dataclass(slots=True)
class _Req:
    key: str
    spec: GenSpec
    seqs: list[_Seq]
    parked: bool = False
    sent: list[int] = field(default_factory=list)
    compiling: Future[Constraint] | None = None
    """Its constraint, until compiled: its sequences are not in the engine until then."""
    beams: BeamRounds | None = None
    """A beam search's rounds (its ``seqs`` then take the best beams at the end)."""

    @property
    def done(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, per row and step
            return seqs[0].finish is not None
        return all(s.finish is not None for s in seqs)


def _turn(m: ChatMessage, fmt: ContentFormat = "string") -> dict[str, Any]:
    """A chat message as chat templates take it: its content in the template's ``fmt``; an
    earlier call's arguments as an object where they parse (HF's convention; the text
    otherwise)."""
    turn: dict[str, Any] = {"role": m.role, "content": template_content(m, fmt)}
    if m.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": c.type,
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    if m.reasoning_content is not None:  # Qwen3's and R1's name, and gpt-oss's
        turn["reasoning_content"] = turn["thinking"] = m.reasoning_content
    return turn


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


COMPILE_WAIT_S = 0.05
"""With nothing else to run, how long a step waits for a constraint being compiled."""
_ALL_SPECIAL: tuple[str, ...] = ("<every special token but the end-of-sequence ones>",)
"""The markers of a text that keeps every special token (``skip_special_tokens`` false)."""


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of the one token ``text`` is (None: it takes more, or none)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _marker(tokenizer: Any, split: Reasoning) -> Marker | None:
    """A reasoning parser's :attr:`~Reasoning.answer_marker` as tokens (None: its tags
    are not tokens of their own, so a text could write them otherwise)."""
    tag, word, tail = split.answer_marker
    first = _single_token(tokenizer, tag)
    if first is None:
        return None
    if not word and not tail:
        return Marker((first,))
    head = [int(t) for t in tokenizer.encode(tag + word, add_special_tokens=False)]
    last = _single_token(tokenizer, tail)
    if head[:1] != [first] or last is None:
        return None
    return Marker(tuple(head), (last,), gap=_MARKER_GAP)


_MARKER_GAP = 20
"""Tokens allowed between a marker's head and tail (vLLM's for gpt-oss: a
``<|constrain|>json`` there)."""


def _windowed(config: Any, context: int) -> str | None:
    """Why some of a model's layers do not attend to the whole context (up to ``context``
    tokens): a sliding window shorter than it, or another kind of layer (linear
    attention, state spaces); None: every layer does. The padded engine serves only the
    latter: its step is built for full attention and does not give sliding layers the
    masks transformers builds for them (on a tiny gpt-oss with a window of 8, its greedy
    tokens left ``generate``'s by the 4th generated token); transformers' paged engine
    follows the model's layer kinds."""
    kinds = set(getattr(config, "layer_types", None) or ())
    other = sorted(kinds - {"full_attention", "sliding_attention"})
    if other:
        return f"has {', '.join(other)} layers"
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in kinds or (not kinds and window is not None)
    if sliding and (not isinstance(window, int) or window < context):
        return f"has a sliding window of {window} tokens, shorter than its context ({context})"
    return None


def _flag(value: Any, name: str) -> bool:
    """A boolean option (TOML gives a bool; anything else is refused, not guessed)."""
    if not isinstance(value, bool):
        raise ValueError(f"options.{name}: {value!r} is not true or false")
    return value


class TextGenerationRunner:
    """A causal LM served with continuous batching (see the module docstring)."""

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
        if path is None:
            raise ValueError("the text-generation runner needs `path`: a model directory")
        opts = dict(options or {})
        self.torch_device = pick_device(device)
        self.device = str(self.torch_device)
        self.dtype = pick_dtype(dtype, self.torch_device)
        gguf = opts.get("gguf_file")
        extra = {"gguf_file": gguf} if gguf else {}
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), **extra)
        self.templates = ChatTemplates.from_options(opts)
        """The chat template options (:mod:`..generation.chat_template`)."""
        if self.templates.template is not None:  # replaces the tokenizer's own (all of them)
            self.tokenizer.chat_template = self.templates.template
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._backend_decode: Callable[..., str] | None = (
            backend.decode
            if backend is not None
            and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False)
            else None
        )
        """The fast tokenizer's own decode: what ``tokenizer.decode`` returns without its
        cleanup (off here), at a quarter of the cost; a step decodes two windows per token."""
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype, **extra)
        self.model = model.to(self.torch_device).eval()
        cfg = self.model.config.get_text_config()
        self.page_size = int(opts.get("page_size", 32))
        self.kv_cache_tokens = int(opts.get("kv_cache_tokens", 16384))
        self.step_tokens = int(opts.get("step_tokens", 512))
        self.max_running = int(opts.get("max_running", 64))
        self.compile_threads = int(opts.get("compile_threads", 1))
        if not 0 <= self.compile_threads <= 16:
            raise ValueError(f"options.compile_threads: {self.compile_threads} is not 0 … 16")
        self.sampling_defaults = defaults.load(
            path,
            opts.get("generation_config", "vllm"),
            opts.get("override_generation_config"),
            gguf,
        )
        """Sampling defaults for the fields a request leaves unset (``generation_config``,
        ``override_generation_config``: :mod:`..generation.defaults`)."""
        if "max_new_tokens" in opts and "max_new_tokens" in self.sampling_defaults.overridden:
            raise ValueError("options.max_new_tokens and override_generation_config's "
                             "max_new_tokens: set one")  # fmt: skip
        self.new_tokens_cap = self.sampling_defaults.cap
        """The most tokens any request generates, its own ``max_new_tokens`` cut to it
        (the generation config's where vLLM makes it a bound: ``SamplingDefaults.cap``)."""
        self.default_new_tokens = self._capped(
            int(opts.get("max_new_tokens", self.sampling_defaults.max_new_tokens or 256))
        )
        """What a request that sets no ``max_new_tokens`` generates at most: the option,
        else the generation config's, else 256 (cut to the cap)."""
        self.schedule_ahead = _flag(opts.get("schedule_ahead", True), "schedule_ahead")
        """The loop plans each step while the one before runs (``gen_scheduler.py``)."""
        self.tool_call_parser: str | None = opts.get("tool_call_parser")
        """How ``tool_choice`` ``auto`` reads calls out of this model's text (None: it
        does not; such requests are refused)."""
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"options.tool_call_parser: {self.tool_call_parser!r} is not one "
                             f"of {', '.join(PARSERS)}")  # fmt: skip
        self.reasoning_parser: str | None = opts.get("reasoning_parser")
        """How a chat's text is split into reasoning and answer (None: it is not)."""
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"options.reasoning_parser: {self.reasoning_parser!r} is not one "
                             f"of {', '.join(REASONING_PARSERS)}")  # fmt: skip
        self._reasoning = (
            None
            if self.reasoning_parser is None
            else reasoning_for(self.reasoning_parser, self.tokenizer.get_vocab())
        )
        split = self._reasoning
        self._markers: Markers | None = markers(
            opts.get("reasoning_config"),
            None if split is None else (split.open, split.close),
            () if split is None else split.enders,
            lambda text: [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)],
        )
        """The markers a ``thinking_token_budget`` counts within (None: it is refused)."""
        self.thinking_budget = self._markers is not None
        """It takes a ``thinking_token_budget`` (published in the model info)."""
        self._harmony = (
            self.reasoning_parser == "openai_gptoss" or self.tool_call_parser == "openai"
        )
        """The model writes harmony messages (gpt-oss): an answer's content is theirs."""
        self._cohere = cohere.FORMATS.get(self.reasoning_parser or "") or cohere.FORMATS.get(
            self.tool_call_parser or ""
        )
        """The model writes Cohere Command's modes (its format): an answer's content is
        its answer's parts, its calls are its calls' parts."""
        self._blocks = block_formats.FORMATS.get(
            self.reasoning_parser or ""
        ) or block_formats.FORMATS.get(self.tool_call_parser or "")
        """The model writes message blocks (its format): an answer's content is its
        format's, its calls are its call blocks, whatever the tool choice."""
        self._calls_parser = (
            "openai" if self._harmony
            else self._cohere.name if self._cohere is not None
            else self._blocks.name if self._blocks is not None
            else self.tool_call_parser
        )  # fmt: skip
        """How calls are read: harmony calls for gpt-oss, Command's calls parts for Cohere,
        whatever the tool choice (the calls it requires are constrained to them), else the
        model's parser's (``hy_v4``'s with the tags its vocabulary ends in)."""
        if self._calls_parser == hy_v4.PARSER:
            self._calls_parser = hy_v4.parser_for(self.tokenizer.get_vocab())
        positions = int(getattr(cfg, "max_position_embeddings", 0) or self.kv_cache_tokens)
        self.context = min(positions, self.kv_cache_tokens)
        """The longest sequence (prompt + generated) it serves."""
        self.max_prompt_tokens = (
            min(max_tokens, self.context - 1) if max_tokens else self.context - 1
        )
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or len(self.tokenizer))
        eos = self.model.generation_config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.eos:
            self.eos.append(int(self.tokenizer.eos_token_id))
        pad = self.tokenizer.pad_token_id
        windowed = _windowed(cfg, self.context)
        self.engine_kind = str(opts.get("engine", "auto"))
        if self.engine_kind == "auto":  # the padded engine where it serves the model
            self.engine_kind = "paged" if windowed else "padded"
        elif self.engine_kind == "padded" and windowed:
            raise ValueError(f"options.engine: 'padded' serves models whose layers attend to "
                             f"the whole context, and this one {windowed}: use 'paged' (or "
                             "leave engine out)")  # fmt: skip
        padded = self.engine_kind == "padded"
        self.prefix_cache_tokens = int(
            opts.get("prefix_cache_tokens", self.kv_cache_tokens // 8 if padded else 0)
        )
        if self.prefix_cache_tokens < 0 or (
            self.prefix_cache_tokens and self.engine_kind != "padded"
        ):
            raise ValueError(f"options.prefix_cache_tokens: {self.prefix_cache_tokens} (at least 0, "
                             "and only with engine 'padded')")  # fmt: skip
        self.speculative = self._speculative(opts.get("speculative"), opts.get("engine"))
        """Speculative decoding, n-gram or a draft model's (``options.speculative``;
        None: off)."""
        names, adapters = self._adapters(opts)
        self.max_lora_rank = int(opts.get("max_lora_rank", 64))
        max_loras = opts.get("max_loras", MAX_LORAS)
        if not isinstance(max_loras, int) or isinstance(max_loras, bool) or max_loras < 1:
            raise ValueError(f"options.max_loras: {max_loras!r} is not a positive integer")
        self._loras = AdapterTable(names, max_loras)
        """The LoRA adapters requests may ask for (``options.lora_adapters``, then those
        loaded and unloaded while it serves)."""
        self._draining_loras: set[int] = set()
        """Labels of adapters unloaded whose requests have not all ended (device thread)."""
        self._reset_prefix = False
        """An operator emptied the prefix cache (:meth:`reset_prefix_cache`): done before
        the next step."""
        self.engine: Engine
        if self.engine_kind == "padded":
            from ..generation.padded import PaddedEngine
            from ..generation.prefix_cache import PrefixCache

            prefix = None
            if self.prefix_cache_tokens:
                prefix = PrefixCache(self.prefix_cache_tokens, self.page_size)
            lean = _flag(opts.get("lean_decode", True), "lean_decode")
            self.engine = PaddedEngine(self.model, eos_token_ids=self.eos,
                                       step_tokens=self.step_tokens, max_running=self.max_running,
                                       lean=lean,
                                       max_context=self.context,
                                       resident_tokens=self.kv_cache_tokens,
                                       prefix_cache=prefix, adapters=adapters,
                                       speculative=self._proposer(lean))  # fmt: skip
        elif self.engine_kind == "paged":
            from ..generation.paged import PagedEngine

            blocks = -(-self.kv_cache_tokens // self.page_size)
            self.engine = PagedEngine(
                self.model,
                eos_token_ids=self.eos,
                pad_token_id=int(pad if pad is not None else (self.eos[0] if self.eos else 0)),
                # One spare block per sequence beyond the scheduler's budget: the engine
                # takes a sequence's next block a little ahead of its use.
                kv_blocks=blocks + self.max_running,
                page_size=self.page_size,
                step_tokens=self.step_tokens,
                max_running=self.max_running,
                cuda_graphs=_flag(opts.get("cuda_graphs", False), "cuda_graphs"),
                adapters=adapters,
            )
        else:
            raise ValueError(f"options.engine: {self.engine_kind!r} is not 'auto', 'padded' or "
                             "'paged'")  # fmt: skip
        self._think_end = (
            None if self._reasoning is None else _marker(self.tokenizer, self._reasoning)
        )
        """The tokens after which a reasoning chat's constraint begins (``</think>``;
        gpt-oss's ``<|channel|>final`` … ``<|message|>``; None: its tags are not tokens
        of their own, or no reasoning parser)."""
        self._think_open = (
            None if self._reasoning is None else _single_token(self.tokenizer, self._reasoning.open)
        )
        """The opening tag's token: where the prompt leaves it to the model whether to
        think, a constraint holds from the first token unless that is this one."""
        self._decodes: dict[tuple[str, ...], Decode] = {}
        """How the texts that parsers read are decoded, by the markers they look for
        (kept where this tokenizer makes them special tokens)."""
        self._grammars = self._make_grammars()
        """Compiles ``structured_outputs`` (a string: why this model cannot take them)."""
        self._reqs: dict[str, _Req] = {}
        self._compiling: dict[str, tuple[_Req, int]] = {}
        """Admitted requests waiting for their constraints, and their lanes."""
        self._unsettled: StepReport | None = None
        """The last step's report, until its progress is filled in."""
        self._by_seq: dict[str, tuple[_Req, _Seq]] = {}
        self._beam_seqs: dict[str, _Req] = {}
        """The beam searches' round sequences in the engine, and their requests."""
        self._spec_seen: tuple[int, int, tuple[int, ...]] = (0, 0, ())
        """The engine's speculation counts at the last step's report."""

    def _proposer(self, lean: bool) -> Proposer | None:
        """The padded engine's proposer: the n-gram config, or the draft model loaded
        (:func:`.draft.load`: a ``ValueError`` where its vocabulary is not the model's;
        ``lean``: ``lean_decode``, for its forwards too)."""
        if not isinstance(self.speculative, DraftConfig):
            return self.speculative
        from ..generation import draft

        return draft.load(self.speculative, self.model, self.step_tokens, self.context, lean)

    def _speculative(self, raw: Any, engine: Any) -> NgramConfig | DraftConfig | None:
        """``options.speculative`` checked (a ``ValueError`` says what is wrong); None where
        it is not set, or the paged engine was picked for the model (it has no
        speculation: a warning says so; naming that engine with it is an error)."""
        if raw is None:
            return None
        config = parse(raw)
        if self.engine_kind == "padded":
            return config
        if engine == "paged":
            raise ValueError("options.speculative needs the padded engine, and options.engine "
                             "is 'paged'")  # fmt: skip
        logger.warning("options.speculative is off: this model runs on the paged engine, "
                       "which does not speculate")  # fmt: skip
        return None

    def _adapters(self, opts: dict[str, Any]) -> tuple[tuple[str, ...], tuple[Adapter, ...]]:
        """``options.lora_adapters`` loaded, checked against the model and engine (a
        ``ValueError`` says what is not served): their names and the adapters."""
        from ..generation.lora import MAX_RANK
        from ..generation.lora import load as load_adapter

        named = opts.get("lora_adapters") or {}
        rank = opts.get("max_lora_rank", 64)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"options.max_lora_rank: {rank!r} is not 1 … {MAX_RANK}")
        if not isinstance(named, dict) or not all(
            isinstance(k, str) and 0 < len(k) <= 128 and isinstance(v, str | Path)
            for k, v in named.items()
        ):
            raise ValueError("options.lora_adapters: a table of adapter names (1-128 "
                             "characters) to adapter directories")  # fmt: skip
        if not named:
            return (), ()
        loaded = tuple(load_adapter(k, v, self.model, rank) for k, v in named.items())
        return tuple(named), loaded

    # --- the loop's side ---------------------------------------------------------------

    def generation_policy(self, lanes: int, lane_weights: tuple[float, ...],
                          max_starvation_ms: float) -> GenPolicy:  # fmt: skip
        """The scheduler's budgets for this model."""
        from ...batching.generation import GenPolicy

        return GenPolicy(
            kv_cache_tokens=self.kv_cache_tokens, page_size=self.page_size,
            step_tokens=self.step_tokens, max_running=self.max_running, lanes=lanes,
            lane_weights=lane_weights, max_starvation_ms=max_starvation_ms,
        )  # fmt: skip

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | PrepareError]:
        return [self._prepare(r) for r in requests]

    def _prepare(self, req: Request) -> Prepared | PrepareError:
        req = self.sampling_defaults.apply(req)  # the model's, for the fields left unset
        try:
            prompts, texts = self._prompts(req)
        except PrepareError as exc:
            return exc
        except Exception as exc:
            return PrepareError(f"cannot tokenize: {type(exc).__name__}: {exc}")
        if req.truncate_prompt_tokens is not None:  # vLLM's: keep the last ones
            cut = [p[-req.truncate_prompt_tokens :] for p in prompts]
            texts = [t if len(c) == len(p) else None
                     for t, c, p in zip(texts, cut, prompts, strict=True)]  # fmt: skip
            prompts = cut
        for i, p in enumerate(prompts):
            if not p:
                return PrepareError(f"input {i} has no tokens", ErrorCode.EMPTY_INPUT)
            if len(p) > self.max_prompt_tokens:
                return PrepareError(
                    f"input {i} has {len(p)} prompt tokens > {self.max_prompt_tokens} "
                    f"(context {self.context})",
                    ErrorCode.TOO_LARGE,
                )
        # bounded by the limits; 0 (falsy) is the prompt only
        wanted = (self.default_new_tokens if req.max_new_tokens is None
                  else self._capped(req.max_new_tokens))  # fmt: skip
        at_least = req.min_new_tokens or 0
        if at_least > wanted:
            return PrepareError(f"min_new_tokens {at_least} > max_new_tokens {wanted}")
        lora = 0
        if req.lora is not None:
            labels = self._loras.labels
            if req.lora not in labels:
                known = ", ".join(labels) or "none"
                return PrepareError(f"lora {req.lora!r} is not one of this model's adapters "
                                    f"({known})")  # fmt: skip
            lora = labels[req.lora]
        use = req.tool_use
        if use is not None and use.kind == "auto" and self.tool_call_parser is None:
            return PrepareError("tool_choice auto (the default with tools) reads calls out of "
                                "the text with the model's tool_call_parser option, which this "
                                "model does not set: send tool_choice required, a named "
                                "function, or none")  # fmt: skip
        constraint: Constraint | None = None
        compiling: Future[Constraint] | None = None
        # gpt-oss writes the calls tool_choice asks for as harmony calls, after its
        # analysis (harmony.calls_grammar), Cohere Command as its calls part, after its
        # reasoning (cohere.calls_grammar): the text is split, constrained from the first
        own_calls = (
            (self._harmony or self._cohere is not None or self._blocks is not None)
            and req.constraint is not None
            and req.structured_outputs is None and req.response_format is None
        )  # fmt: skip
        # a chat to a reasoning model is split; a constraint then begins after its
        # reasoning, where </think> is one token (else it holds from the first: no split),
        # or from the first token where the prompt closed the reasoning; gpt-oss's in its
        # final message, Cohere's after its answer's marker, or, for calls, from the first
        # token (the grammar frees the reasoning)
        thinking = None
        if self._reasoning is not None and req.messages is not None:
            end = self.tokenizer.decode(prompts[0][-16:], skip_special_tokens=False)
            thinking = self._reasoning.opens(end)
        # gpt-oss (Cohere Command) under auto with strict functions: its messages (modes)
        # held from the first (harmony.auto_grammar, cohere.auto_grammar), split as ever
        own_strict = (
            (self._harmony or self._cohere is not None) and use is not None and use.kind == "auto"
            and req.constraint is None and any(t.function.strict for t in req.tools or ())
        )  # fmt: skip
        budgets = self._budgets(req, prompts, thinking)
        if isinstance(budgets, PrepareError):
            return budgets
        try:  # nothing generated (max_new_tokens 0): nothing to constrain
            constrained = self._constraint(req, own_calls, thinking) if wanted else None
        except PrepareError as exc:
            return exc
        if constrained is not None:
            compiling = constrained
            if compiling.done():  # compiled before (or here): refused now if it failed
                try:
                    constraint, compiling = compiling.result(), None
                except GrammarError as exc:
                    return PrepareError(str(exc))
        bias = {int(k): b for k, b in (req.logit_bias or {}).items()}
        think_end = None if own_calls or own_strict else self._think_end
        reasoning = (
            self._reasoning is not None
            and req.messages is not None
            and (constrained is None or thinking is False or think_end is not None
                 or own_calls or own_strict)
        )  # fmt: skip
        allowed = tuple(sorted(set(req.allowed_token_ids or ())))
        for name, ids in (("stop_token_ids", req.stop_token_ids or ()), ("logit_bias", bias),
                          ("allowed_token_ids", allowed)):  # fmt: skip
            unknown = sorted(t for t in ids if t >= self.vocab_size)
            if unknown:
                return PrepareError(f"{name} {unknown[:8]} are not tokens of this model "
                                    f"(vocabulary {self.vocab_size})")  # fmt: skip
        spec = GenSpec(
            prompts=tuple(tuple(p) for p in prompts),
            max_new_tokens=tuple(min(wanted, self.context - len(p)) for p in prompts),
            sampling=Sampling(
                req.temperature or 0.0,
                req.top_p if req.top_p is not None else 1.0,
                req.top_k or 0,
                req.seed,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                min_new_tokens=at_least,
                logit_bias=tuple(sorted(bias.items())),
                ignore_eos=bool(req.ignore_eos),
                min_p=req.min_p or 0.0,
                logprobs=req.logprobs,
                constraint=constraint,
                allowed_tokens=allowed,
                bad_words=self._bad_words(req.bad_words or ()),
                constraint_after=think_end
                if reasoning and constrained is not None and thinking is not False
                else None,
                constraint_unless=self._think_open
                if reasoning and constrained is not None and thinking is None
                else None,
            ),
            stop=tuple(req.stop or ()),
            stream=bool(req.stream),
            stop_ids=frozenset(req.stop_token_ids or ()),
            n=req.n or 1,
            keep_stop=bool(req.include_stop_str_in_output),
            prompt_logprobs=req.prompt_logprobs,
            tools=use,
            reasoning=reasoning,
            thinking=thinking,
            tool_types=param_types(req.tools)
            if req.tools
            and (
                self._blocks is not None
                or ALIASES.get(self._calls_parser or "", self._calls_parser) in TYPED_ARGS
            )
            else {},
            skip_special=req.skip_special_tokens is not False,
            token_ids=bool(req.return_token_ids),
            cache_salt=req.cache_salt,
            prompt_texts=tuple(
                t if t is not None else self.tokenizer.decode(p, skip_special_tokens=False)
                for t, p in zip(texts, prompts, strict=True)
            )
            if req.return_prompt_text
            else None,
            token_strs=bool(req.return_token_strs),
            compiling=compiling,
            lora=lora,
            lora_name=req.lora,
            beam=bool(req.use_beam_search),
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
            budgets=budgets,
        )
        lengths = tuple(len(p) for p in prompts for _ in range(spec.n))
        # the KV cache holds per sequence its prompt, or nothing where it is answered when
        # admitted (nothing to generate, nor to score)
        scored = req.prompt_logprobs is not None  # the first completion of each prompt
        held = tuple(len(p) if wanted or (scored and j == 0) else 0
                     for p in prompts for j in range(spec.n))  # fmt: skip
        return Prepared(spec, rows=len(lengths), tokens=max(lengths), prompts=held,
                        max_new_tokens=max(spec.max_new_tokens))  # fmt: skip

    def _capped(self, tokens: int) -> int:
        """``tokens`` cut to :attr:`new_tokens_cap` (vLLM's ``get_max_tokens`` takes the
        least of a request's ``max_tokens`` and the ``override_max_tokens``)."""
        cap = self.new_tokens_cap
        return tokens if cap is None else min(tokens, cap)

    def _budgets(self, req: Request, prompts: Sequence[Sequence[int]],
                 thinking: bool | None) -> tuple[ThinkBudget, ...] | PrepareError:  # fmt: skip
        """Per prompt, its ``thinking_token_budget`` (empty: none asked). A prompt whose
        tokens leave the reasoning open begins in it, those tokens counted (vLLM's); else a
        chat's text begins in its reasoning as its split tells (``thinking``), a prompt's
        (or a chat's to a model without a reasoning parser) as its end's markers tell."""
        budget, marks = req.thinking_token_budget, self._markers
        if budget is None:
            return ()
        if marks is None:
            return PrepareError("thinking_token_budget: this model has no reasoning markers "
                                "(options.reasoning_parser with tags, or "
                                "options.reasoning_config)")  # fmt: skip
        if req.messages is not None and self._reasoning is not None:
            return tuple(marks.budget(budget, thinking, p) for p in prompts)
        return tuple(
            marks.budget(budget, marks.opens(self.tokenizer.decode(list(p[-16:]),
                                                                   skip_special_tokens=False)), p)
            for p in prompts
        )  # fmt: skip

    def _bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as written alone and after a space (vLLM's ``bad_words``)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)

    def _constraint(
        self, req: Request, own_calls: bool = False, thinking: bool | None = None
    ) -> Future[Constraint] | None:
        """The request's ``structured_outputs`` (or ``response_format``, or the calls
        its ``tool_choice`` asks for; ``own_calls``: as gpt-oss or Cohere Command writes
        them, ``thinking`` telling where Command's text begins; or, for ``auto`` with
        ``strict`` functions, the calls in the model's format), compiled for this
        tokenizer or being compiled (:meth:`Grammars.submit`); None: the text is free."""
        spec = req.constraint
        use = req.tool_use
        grammar: str | None = None
        if own_calls and self._blocks is not None:
            return None  # written natively, read as auto (as vLLM's parsers take them)
        if own_calls:
            assert use is not None and req.tools is not None
            fns = called(req.tools, use)
            fmt = self._cohere
            grammar = (
                harmony.calls_grammar(fns)
                if fmt is None
                else cohere.calls_grammar(fmt, cohere.begins(fmt, thinking), fns, use.parallel)
            )
        elif spec is not None and spec.structural_tag is not None:
            grammars = self._grammars
            if isinstance(grammars, str):
                raise PrepareError(f"structural_tag: {grammars}")
            grammar = struct_tag.grammar(spec.structural_tag, grammars.token)
        elif spec is None and use is not None and use.kind == "auto" and req.tools:
            if not any(t.function.strict for t in req.tools):
                return None
            grammars = self._grammars
            if isinstance(grammars, str):
                raise PrepareError(f"strict functions: {grammars}")
            parser = ALIASES.get(self._calls_parser or "", self._calls_parser)
            functions = [(t.function.name, t.function.parameters, bool(t.function.strict))
                         for t in req.tools]  # fmt: skip
            if self._harmony:
                grammar = harmony.auto_grammar(functions)
            elif self._cohere is not None:  # its markers special tokens, else not enforced
                held = all(grammars.token(m) is not None for m in self._cohere.tokens)
                grammar = (
                    cohere.auto_grammar(self._cohere, functions, use.parallel) if held else None
                )
            else:
                grammar = strict_calls.grammar(
                    parser or "", functions, use.parallel, grammars.token
                )
            if grammar is None:
                return None  # a format the grammars do not hold: strict not enforced
        if grammar is not None:
            spec = StructuredOutputs.model_construct(grammar=grammar)  # tools are bounded
        if spec is None:
            return None
        if req.ignore_eos:
            raise PrepareError("structured_outputs ends the text with an end-of-sequence "
                               "token: it does not go with ignore_eos")  # fmt: skip
        grammars = self._grammars
        if isinstance(grammars, str):
            raise PrepareError(grammars)
        try:
            return grammars.submit(spec)
        except GrammarError as exc:
            raise PrepareError(str(exc)) from exc

    def _make_grammars(self) -> Grammars | str:
        """The compiler for this tokenizer, or why there is none."""
        if not self.eos:
            return "structured_outputs: this model has no end-of-sequence token"
        try:
            return Grammars(self.tokenizer, self.vocab_size, self.eos, self.compile_threads)
        except Exception as exc:  # a slow (Python) tokenizer, or a vocabulary it cannot read
            logger.warning("structured outputs are off for this model: %s: %s",
                           type(exc).__name__, exc)  # fmt: skip
            return (f"structured_outputs: this model's tokenizer cannot be used for them "
                    f"({type(exc).__name__}: {exc})")  # fmt: skip

    def _prompts(self, req: Request) -> tuple[list[list[int]], list[str | None]]:
        """Each input's prompt tokens, and its text where there is one: a text input's,
        a chat's rendered template (rendered only for ``return_prompt_text``)."""
        if req.messages is not None:
            try:
                template = self.templates.request_template(req.chat_template)
            except TemplateRefused as exc:
                raise PrepareError(str(exc)) from None
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            if template is None:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise PrepareError("this model has no chat template: send `inputs` (prompts), "
                                       "or set its chat_template option")  # fmt: skip
                template = self.tokenizer.get_chat_template(None, tools=tools)
            go_on = bool(req.continue_final_message)
            variables = self.templates.kwargs(req.chat_template_kwargs)
            if req.reasoning_effort is not None:  # over a default's
                variables["reasoning_effort"] = req.reasoning_effort
            kwargs: dict[str, Any] = dict(
                tools=tools,
                add_generation_prompt=not go_on and req.add_generation_prompt is not False,
                continue_final_message=go_on,
                chat_template=template,
                **variables,
            )
            fmt = self.templates.format_for(template)
            turns = [_turn(m, fmt) for m in req.messages]
            text = None
            if req.return_prompt_text or req.add_special_tokens:  # as rendered
                text = str(self.tokenizer.apply_chat_template(turns, tokenize=False, **kwargs))
            if req.add_special_tokens:  # vLLM's: the tokenizer's own added to the template's
                return [list(self.tokenizer(text)["input_ids"])], [text]
            ids = self.tokenizer.apply_chat_template(turns, tokenize=True, **kwargs)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [list(ids)], [text if req.return_prompt_text else None]
        prompts: list[list[int]] = []
        texts: list[str | None] = []
        for i, item in enumerate(req.inputs):
            texts.append(item if isinstance(item, str) else None)
            if isinstance(item, str):
                special = req.add_special_tokens is not False
                prompts.append(list(self.tokenizer(item, add_special_tokens=special)["input_ids"]))
            elif isinstance(item, TokenPrompt):  # taken as they are
                if (top := max(item.prompt_token_ids)) >= self.vocab_size:
                    raise PrepareError(f"inputs[{i}].prompt_token_ids: {top} is not a token of "
                                       f"this model (vocabulary {self.vocab_size})",
                                       ErrorCode.INVALID_INPUT)  # fmt: skip
                prompts.append(list(item.prompt_token_ids))
            else:
                raise PrepareError("a text-generation model takes texts or prompt_token_ids "
                                   "(prompts), or messages", ErrorCode.INVALID_INPUT)  # fmt: skip
        return prompts, texts

    # --- the device's side -------------------------------------------------------------

    def step(self, work: Work) -> StepReport:
        if self._unsettled is not None:  # settled here if its caller did not
            self._unsettled.settle()
            self._unsettled = None
        produced: dict[str, int] = {}
        report = StepReport(produced=produced)
        events: list[StepEvent] = []
        if work.step_tokens is not None and work.step_tokens != self.step_tokens:
            self.step_tokens = work.step_tokens  # an operator's live change (bf_policy)
            self.engine.set_step_tokens(work.step_tokens)
        if self._loras.pending:  # an operator's adapter loaded or unloaded (bf_load_lora)
            self._lora_changes()
        if self._reset_prefix:  # an operator's bf_reset_prefix_cache
            self._reset_prefix = False
            self._empty_prefix_cache()
        for key, reason in work.stop:
            r = self._reqs.get(key)
            if r is not None:
                self._end(r, reason)
                events += self._finish(r, stream=reason != LOST)
        for key in work.preempt:
            r = self._reqs.get(key)
            if r is not None and not r.parked:
                events.append(self._park(r))
        lanes = work.lanes or (0,) * len(work.admit)
        for (key, prep), lane in zip(work.admit, lanes, strict=True):
            if prep.payload.lora and key not in self._reqs and not self._lora_live(prep):
                events.append(Failed(key, f"lora adapter {prep.payload.lora_name!r} was "
                                     "unloaded", ErrorCode.INVALID_REQUEST))  # fmt: skip
                continue
            if (answered := self._admit(key, prep, lane)) is not None:
                events += self._finish(answered)
        if self._compiling:
            self._compiled(events)
        failure = ""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if not is_out_of_memory(exc):
                return self._failed_step(exc, events, report)
            failure = f"{type(exc).__name__}: {exc}"
        if failure:  # handled out here, once the failed step's tensors are freed with it
            return self._out_of_memory(failure, events, report)
        prefilled = 0
        if self._beam_seqs:
            outputs, beam_events, prefilled = self._beam_step(outputs, produced)
            events += beam_events
        if self.speculative is not None:
            self._speculated(report)
        # per row and step (the deltas wait for it): kept lean
        touched: dict[str, _Req] = {}
        by_seq = self._by_seq
        for out in outputs:
            found = by_seq.get(out.sequence)
            if found is None:
                continue  # ended or parked meanwhile
            r, seq = found
            text = seq.text
            if not text.tokens and out.tokens:  # its prefill ended (its first token)
                prefilled += len(seq.prompt) - self.engine.cached(seq.name)
            if not seq.max_new:  # a prompt to score, and nothing to generate
                if out.tokens or out.finished:  # scored: the token its prefill took is dropped
                    seq.finish = "length"
                    if not out.finished:
                        self.engine.cancel([seq.name])
                    by_seq.pop(seq.name, None)
                    touched[r.key] = r
                continue
            new = out.tokens[len(text.tokens) - seq.base :]
            stop_ids = r.spec.stop_ids
            ended = False
            if stop_ids:
                for k, t in enumerate(new):
                    if t in stop_ids:  # kept, and nothing after it
                        new, ended = new[: k + 1], True
                        break
            if text.stop and len(new) > 1:  # (speculation) no token after a stop string's
                for k, t in enumerate(new):
                    text.extend((t,))
                    if text.stopped_at is not None:
                        new = new[: k + 1]
                        break
            else:
                text.extend(new)
            if new:
                produced[r.key] = produced.get(r.key, 0) + len(new)
            if text.stopped_at is not None or ended:
                seq.finish = "stop"
                # vLLM's: a stop string, else the stop token (an end-of-sequence one: none)
                if text.stopped_at is not None:
                    seq.stop_reason = text.stop_string
                elif seq.sampling.ignore_eos or new[-1] not in self.eos:
                    seq.stop_reason = new[-1]
                self.engine.cancel([seq.name])
            elif out.finished:
                eos = bool(text.tokens) and text.tokens[-1] in self.eos
                seq.finish = "stop" if eos and not seq.sampling.ignore_eos else "length"
            if seq.finish is not None:
                by_seq.pop(seq.name, None)
            touched[r.key] = r
        for r in touched.values():
            if r.done:
                events += self._finish(r)
            elif r.spec.stream:
                events += self._deltas(r)
        report.events = events
        report.prefilled = prefilled
        report.compiling = len(self._compiling)
        if not isinstance(self._grammars, str) and self._grammars.took:
            took = self._grammars.took
            report.compiled_s = tuple(took.popleft() for _ in range(len(took)))
        # after the deltas: the device thread streams them first, then settles this
        report.deferred = lambda: self._fill_progress(report)
        self._unsettled = report
        return report

    def _speculated(self, report: StepReport) -> None:
        """The step's speculation, in ``report``: the engine's counts since the last."""
        from ..generation.padded import PaddedEngine

        e = self.engine
        assert isinstance(e, PaddedEngine)
        rows, drafts = e.drafted
        seen_rows, seen_drafts, seen = self._spec_seen
        if rows == seen_rows:
            return
        report.drafted = (rows - seen_rows, drafts - seen_drafts)
        report.accepted = tuple(n - (seen[j] if j < len(seen) else 0)
                                for j, n in enumerate(e.accepted))  # fmt: skip
        self._spec_seen = (rows, drafts, tuple(e.accepted))

    # --- LoRA adapters while it serves --------------------------------------------------

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The names of the LoRA adapters a new request may ask for now."""
        return self._loras.names

    @property
    def max_loras(self) -> int:
        return self._loras.max_loras

    def load_lora(self, name: str, path: str | Path) -> None:
        """Any thread but the device's (a control command's): read and check the adapter at
        ``path`` as at startup (a ``ValueError`` says what is refused; nothing changes
        then) and hand it to the device thread, which serves it from its next step on."""
        from ..generation.lora import load as load_adapter

        self._loras.reserve(name)
        try:
            adapter = self.engine.fuse_adapter(
                load_adapter(name, path, self.model, self.max_lora_rank)
            )
        except ValueError as exc:
            self._loras.release(name)
            raise ValueError(str(exc).removeprefix("options.lora_adapters: ")) from None
        except BaseException:
            self._loras.release(name)
            raise
        self._loras.add(name, adapter)

    def unload_lora(self, name: str) -> None:
        """Any thread: no new request may name ``name`` (``invalid_request``); those
        already started under it end under it (vLLM's: a running request keeps its
        adapter), then its memory goes. A ``ValueError`` where it is not loaded."""
        self._loras.remove(name)

    def lora_requests(
        self, queued: Iterable[tuple[str, str | None]] = ()
    ) -> dict[str, tuple[int, int]]:
        """Any thread: per adapter a new request may name, its requests running and waiting
        here (preempted, waiting for a constraint, or ``queued``: ``(key, adapter)`` of
        those its loop read and has not admitted yet); read at a metrics scrape."""
        names = {label: name for name, label in self._loras.labels.items()}
        out = dict.fromkeys(names.values(), (0, 0))
        reqs = dict(self._reqs)
        for key, lora in queued:
            if lora in out and key not in reqs:  # (a preempted one: counted below)
                running, waiting = out[lora]
                out[lora] = (running, waiting + 1)
        for r in reqs.values():
            name = names.get(r.spec.lora)
            if name is not None:
                running, waiting = out[name]
                if r.parked or r.compiling is not None:
                    out[name] = (running, waiting + 1)
                else:
                    out[name] = (running + 1, waiting)
        return out

    def lora_bytes(self) -> dict[str, int]:
        """Any thread: per adapter the engine holds (an unloaded one until its requests
        end), the memory its weights take (:func:`..generation.lora.nbytes`); read at a
        metrics scrape."""
        from ..generation.lora import nbytes

        out: dict[str, int] = {}
        for a in self.engine.adapters:
            if a is not None:  # (a name reloaded while its old weights drain: both)
                out[a.name] = out.get(a.name, 0) + nbytes(a)
        return out

    def _lora_changes(self) -> None:
        """Between steps: the adapters loaded since put in the engine, and those unloaded
        taken out of it once none of their requests is left."""
        engine = self.engine
        for change in self._loras.take():
            if change.adapter is not None:
                engine.set_adapter(change.label, change.adapter)
                logger.info("LoRA adapter %r loaded (label %d)", change.adapter.name, change.label)
            else:
                self._draining_loras.add(change.label)
        if self._draining_loras:
            used = {r.spec.lora for r in self._reqs.values()}
            for label in sorted(self._draining_loras - used):
                engine.set_adapter(label, None)
                self._draining_loras.discard(label)
                logger.info("LoRA adapter of label %d unloaded", label)
        self._loras.settled(bool(self._draining_loras))

    def _lora_live(self, prep: Prepared) -> bool:
        """Whether a new request's adapter may start (not unloaded since it was read). One
        read with it was loaded before: before its step began, which put it in the engine."""
        return prep.payload.lora in self._loras.labels.values()

    def reset_prefix_cache(self) -> bool:
        """Any thread: empty the prefix cache before the next step (vLLM's
        ``reset_prefix_cache``), so no prompt admitted after this call takes a block held
        before it; running sequences keep their own keys and values (blocks are copies;
        the paged engine's shared blocks stay with their users). False: the model has no
        prefix cache (``prefix_cache_tokens`` 0; the paged engine, a sliding-window model)."""
        from ..generation.paged import PagedEngine

        if isinstance(self.engine, PagedEngine):
            if not self.engine.sharing.on:
                return False
        elif self.prefix_cache_tokens == 0:
            return False
        self._reset_prefix = True
        return True

    def _empty_prefix_cache(self) -> None:
        from ..generation.padded import PaddedEngine
        from ..generation.paged import PagedEngine

        if isinstance(self.engine, PaddedEngine) and self.engine.prefix is not None:
            logger.info("prefix cache emptied (%d tokens held)", self.engine.prefix.tokens)
            self.engine.prefix.clear()
        elif isinstance(self.engine, PagedEngine):
            logger.info("shared blocks forgotten (%d blocks)", self.engine.forget_blocks())

    def forget_all(self) -> None:
        """Drop every request and empty the engine: the loop crashed and starts over, and
        reads its requests again (as a new worker would), sampled ones with fresh generators.
        Call with the device thread gone."""
        self.engine.forget_all()
        self._reqs.clear()
        self._by_seq.clear()
        self._beam_seqs.clear()
        self._compiling.clear()
        self._unsettled = None

    def _fill_progress(self, report: StepReport) -> None:
        for key, r in self._reqs.items():
            if not r.parked:
                report.progress[key] = self._progress(r)

    def _admit(self, key: str, prep: Prepared, lane: int) -> _Req | None:
        """Take an admitted request (new, or resumed); a new one with nothing for the
        engine to do is returned, to be answered at once."""
        r = self._reqs.get(key)
        if r is None:
            spec: GenSpec = prep.payload
            n = spec.n
            use = spec.tools
            markers = (
                MARKERS.get(self._calls_parser or "", ()) if use and use.kind == "auto" else ()
            )
            if self._harmony and use is not None:  # harmony calls, whatever the choice
                markers = harmony.TOKENS
            if self._cohere is not None and use is not None:  # and Command's
                markers = self._cohere.tokens
            if self._blocks is not None and use is not None:  # and the blocks'
                markers = self._blocks.tokens
            tags = self._reasoning.tags if spec.reasoning and self._reasoning else ()
            decode = self._marked(markers + tags
                                  if spec.skip_special else _ALL_SPECIAL)  # fmt: skip
            # nothing to generate (max_new_tokens 0): only a prompt to score runs, greedily
            # (its token is dropped); the other sequences end now, with no engine work
            seqs = [_Seq(f"{key}#{i * n + j}", p, m, TextStream(decode, spec.stop, spec.keep_stop),
                         spec.sampling_of(j, i) if m else Sampling(),
                         score=spec.prompt_logprobs if j == 0 else None, split=self._split(spec),
                         finish=None if m or (j == 0 and spec.prompt_logprobs is not None)
                         else "length")
                    for i, (p, m) in enumerate(zip(spec.prompts, spec.max_new_tokens, strict=True))
                    for j in range(n)]  # fmt: skip
            r = _Req(key, spec, seqs, sent=[0] * len(seqs), compiling=spec.compiling)
            if spec.beam:
                r.beams = self._beam_rounds(key, spec)
            if r.done:
                return r
            self._reqs[key] = r
        r.parked = False
        if r.compiling is not None:  # it starts once its constraint is compiled
            self._compiling[key] = (r, lane)
            return None
        self._start(r, lane)
        return None

    def _split(self, spec: GenSpec) -> OutputSplit | None:
        """A new output's split (None: its text is not split)."""
        use = spec.tools
        if not spec.reasoning and use is None:
            return None
        reasoning = self._reasoning if spec.reasoning else None
        if reasoning is None and self._blocks is not None and use is not None and spec.stream:
            # vLLM's block tool parsers stream the reasoning blocks too (not in a whole
            # result): a stream's deltas, and so its result, carry them
            reasoning = reasoning_for(self._blocks.name)
        split = OutputSplit(reasoning, spec.thinking, self._harmony, cohere=self._cohere,
                            blocks=self._blocks)  # fmt: skip
        if use is not None:
            split.channels = self._calls_parser == "kimi_k3"  # unwrapped where no split is
            if self._cohere is not None or self._blocks is not None:  # whatever the choice
                use = replace(use, kind="auto", name=None)
            split.calls = CallReader(use, self._calls_parser, spec.tool_types)
            if spec.stream:
                split.chunks = CallChunks(split.calls, use, self._calls_parser, spec.tool_types)
        return split

    def _beam_rounds(self, key: str, spec: GenSpec) -> BeamRounds:
        """A beam request's searches, one per prompt, before their first round."""
        ending = self._ending(spec)
        eos = frozenset() if spec.sampling.ignore_eos else frozenset(self.eos)
        searches = [BeamSearch(len(p), spec.n, m, spec.length_penalty, eos, ending)
                    for p, m in zip(spec.prompts, spec.max_new_tokens, strict=True)]  # fmt: skip
        return BeamRounds(key, spec.prompts, searches, spec.cache_salt, spec.lora,
                          temperature=spec.sampling.temperature, seed=spec.sampling.seed)  # fmt: skip

    def _ending(self, spec: GenSpec) -> Ending:
        """What ends a beam, as it ends a sampled text: an end-of-sequence token (unless
        ``ignore_eos``), a stop token id, a stop string (looked for in the text of its last
        tokens: an earlier one would have ended it before)."""
        eos = frozenset() if spec.sampling.ignore_eos else frozenset(self.eos)
        stop_ids, stops = spec.stop_ids, spec.stop
        window = 2 * max(map(len, stops)) + 8 if stops else 0
        decode = self._decode

        def ending(tokens: tuple[int, ...]) -> tuple[str, str | int | None] | None:
            last = tokens[-1]
            if last in eos:
                return "stop", None
            if last in stop_ids:
                return "stop", last
            if stops:
                text = decode(tokens[-window:])
                for s in stops:
                    if s in text:
                        return "stop", s
            return None

        return ending

    def _beam_step(
        self, outputs: list[Output], produced: dict[str, int]
    ) -> tuple[list[Output], list[StepEvent], int]:
        """The beam rounds' outputs taken (each search that advanced starts its next round,
        or its request ends); the other outputs, the ended requests' events, and the
        prompt tokens the rounds' sequences prefilled (each round is a prompt of its own,
        as vLLM's beam search makes each an engine request)."""
        rest = []
        advanced: dict[str, _Req] = {}
        prefilled = 0
        for out in outputs:
            r = self._beam_seqs.pop(out.sequence, None)
            if r is None:
                rest.append(out)
                continue
            if r.beams is None:
                continue
            prefilled += r.beams.prefilled(self.engine, out)
            if r.beams.took(self.engine, out):
                advanced[r.key] = r
                produced[r.key] = produced.get(r.key, 0) + 1
        events: list[StepEvent] = []
        for r in advanced.values():
            assert r.beams is not None
            if r.beams.done:
                self._beam_results(r)
                events += self._finish(r)
            else:
                self._start(r, r.beams.lane)
        return rest, events, prefilled

    def _beam_results(self, r: _Req) -> None:
        """A beam request's outputs take its best beams (prompt by prompt, best first). A
        beam an end-of-sequence token ended leaves it out (its ``token_ids``, its
        ``completion_tokens``) unless ``include_stop_str_in_output``, as vLLM's beams do."""
        assert r.beams is not None
        n = r.spec.n
        best = [s.best() for s in r.beams.searches]
        eos = frozenset(() if r.spec.sampling.ignore_eos or r.spec.keep_stop else self.eos)
        for k, seq in enumerate(r.seqs):
            beams = best[k // n]
            if k % n >= len(beams):  # ended before its first round
                seq.finish = seq.finish or "length"
                continue
            beam = beams[k % n]
            ended = beam.finish == "stop" and beam.stop_reason is None and beam.tokens[-1] in eos
            seq.text.extend(list(beam.tokens[:-1] if ended else beam.tokens))
            seq.finish, seq.stop_reason = beam.finish or "length", beam.stop_reason

    def _beam_cancel(self, r: _Req) -> None:
        """Take a beam request's round out of the engine."""
        assert r.beams is not None
        for name in r.beams.pending:
            self._beam_seqs.pop(name, None)
        r.beams.cancel(self.engine)

    def _start(self, r: _Req, lane: int) -> None:
        """Put a request's unfinished sequences in the engine."""
        if r.beams is not None:
            r.beams.lane = lane
            for name in r.beams.start(self.engine):
                self._beam_seqs[name] = r
            return
        for seq in r.seqs:
            if seq.finish is not None:
                continue
            done = len(seq.text.tokens)
            seq.base = done
            # a prompt scored already (its prefill ended: it generated) is not scored again
            self.engine.add(seq.name, list(seq.prompt) + seq.text.tokens, seq.max_new - done,
                            seq.sampling, priority=lane, score=seq.score if not done else None,
                            salt=r.spec.cache_salt, lora=r.spec.lora)  # fmt: skip
            self._by_seq[seq.name] = (r, seq)

    def _compiled(self, events: list[StepEvent]) -> None:
        """Start the requests whose constraints are now compiled (with nothing else to
        run, wait a while for one); a constraint llguidance refused fails its request."""
        pending = [r.compiling for r, _ in self._compiling.values()
                   if r.compiling is not None and not r.parked]  # fmt: skip
        if pending and not self._by_seq:  # the device has nothing else to do
            wait(pending, timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        for key, (r, lane) in list(self._compiling.items()):
            fut = r.compiling
            if self._reqs.get(key) is not r or r.parked or fut is None:
                del self._compiling[key]  # ended, or preempted (admitted again later)
            elif fut.done():
                del self._compiling[key]
                try:
                    constraint = fut.result()
                except Exception as exc:  # GrammarError: the request's own fault
                    code = ErrorCode.INVALID_REQUEST if isinstance(exc, GrammarError) else (
                        ErrorCode.INFERENCE_FAILED)  # fmt: skip
                    events.append(Failed(key, str(exc), code))
                    self._reqs.pop(key, None)
                    for seq in r.seqs:
                        self.engine.forget(seq.name)
                    continue
                r.compiling = None
                for seq in r.seqs:
                    seq.sampling = replace(seq.sampling, constraint=constraint)
                self._start(r, lane)

    def _park(self, r: _Req) -> Preempted:
        """Free a request's sequences and keep its tokens; it resumes when admitted again."""
        if r.beams is not None:
            self._beam_cancel(r)
            r.parked = True
            contexts, left = r.beams.contexts()
            return Preempted(r.key, contexts, left)
        live = [s for s in r.seqs if s.finish is None]
        self._cancel(live)
        r.parked = True
        prompts = tuple(len(s.prompt) + len(s.text.tokens) for s in live)
        left = max((s.max_new - len(s.text.tokens) for s in live), default=0)
        return Preempted(r.key, prompts, left)

    def _cancel(self, seqs: list[_Seq]) -> None:
        """Take sequences out of the engine (those it still has), freeing their blocks."""
        live = [s for s in seqs if self._by_seq.pop(s.name, None) is not None]
        self.engine.cancel(s.name for s in live)

    def _end(self, r: _Req, reason: str) -> None:
        if r.beams is not None:  # the best beams so far, ended for ``reason``
            self._beam_cancel(r)
            r.beams.stop(reason)
            self._beam_results(r)
            return
        live = [s for s in r.seqs if s.finish is None]
        self._cancel(live)
        for s in live:
            s.finish = reason

    def _finish(self, r: _Req, stream: bool = True) -> list[StepEvent]:
        """A request's last events: its unsent text (streaming), then its Final."""
        tail = self._deltas(r, final=True) if stream and r.spec.stream else []
        return [*tail, self._final(r)]

    def _final(self, r: _Req) -> Final:
        self._reqs.pop(r.key, None)
        self._cancel(r.seqs)
        outputs: list[dict[str, Any]] = [
            {"text": s.text.final_text, "finish_reason": s.finish or "stop",
             "prompt_tokens": len(s.prompt), "completion_tokens": len(s.text.tokens),
             "cached_tokens": self.engine.cached(s.name)}
            for s in r.seqs
        ]  # fmt: skip
        for s, out in zip(r.seqs, outputs, strict=True):
            if s.stop_reason is not None and s.finish == "stop":
                out["stop_reason"] = s.stop_reason
        if r.beams is not None and r.beams.cached:
            for k, out in enumerate(outputs):
                out["cached_tokens"] = max(r.beams.cached[k // r.spec.n], 0)
        if r.spec.prompt_texts is not None:
            for i, text in enumerate(r.spec.prompt_texts):
                outputs[i * r.spec.n]["prompt_text"] = text
        if r.spec.sampling.logprobs is not None:
            for s, out in zip(r.seqs, outputs, strict=True):
                out["logprobs"] = self._logprobs(self.engine.logprobs(s.name)[: len(s.text.tokens)])
        for s, out in zip(r.seqs, outputs, strict=True):
            if s.split is not None:
                out.update(s.split.result(s.text.final_text))
        if r.spec.token_ids:
            for k, (s, out) in enumerate(zip(r.seqs, outputs, strict=True)):
                out["token_ids"] = list(s.text.tokens)
                if k % r.spec.n == 0:  # the first completion of its prompt
                    out["prompt_token_ids"] = list(s.prompt)
        if r.spec.token_strs:
            for s, out in zip(r.seqs[:: r.spec.n], outputs[:: r.spec.n], strict=True):
                strs = self.tokenizer.convert_ids_to_tokens(list(s.prompt))
                out["prompt_token_strs"] = list(strs)
        for s, out in zip(r.seqs, outputs, strict=True):
            if s.score is not None:
                out["prompt_logprobs"] = self._prompt_logprobs(s)
        for s in r.seqs:
            self.engine.forget(s.name)
        return Final(r.key, outputs)

    def _prompt_logprobs(self, s: _Seq) -> list[dict[str, Any] | None]:
        """A scored sequence's prompt log-probabilities; the first token has none (vLLM's
        null)."""
        return [None, *self._logprobs(self.engine.prompt_logprobs(s.name))]

    def _logprobs(self, kept: list[Logprob]) -> list[dict[str, Any]]:
        """A sequence's kept log-probabilities as ``TokenLogprob`` maps, tokens decoded."""
        ids = sorted({t for token, _, top, _, _ in kept for t in (token, *top)})
        texts = dict(zip(ids, self.tokenizer.batch_decode([[i] for i in ids],
                                                          skip_special_tokens=False), strict=True))  # fmt: skip
        return [
            {"token": token, "text": texts[token], "logprob": lp, "rank": rank,
             "top": [{"token": t, "text": texts[t], "logprob": v}
                     for t, v in zip(top, values, strict=True)]}
            for token, lp, top, values, rank in kept
        ]  # fmt: skip

    def _deltas(self, r: _Req, final: bool = False) -> list[StepEvent]:
        """One Partial per input with tokens not yet sent: their text that can be released
        (all of it when ``final``). Its text may be empty (tokens that show none yet: part of
        a character, the possible start of a stop string; or none at all, such as the
        end-of-sequence token), so a stream's first delta is its first token and the deltas'
        tokens and log-probabilities add up to the result's. A split output's deltas carry
        its ``content`` (and a reasoning one's ``reasoning_content``) piece by piece, which
        add up to the result's, and each tool call once, in the delta that completes it."""
        out: list[StepEvent] = []
        sent = r.sent
        for i, s in enumerate(r.seqs):
            text = s.text.delta(final)
            n = len(s.text.tokens)
            split = s.split
            parts = ({} if split is None else
                     split.delta(s.text.released, text, s.text.final_text if final else None))  # fmt: skip
            if text or n > sent[i] or any(parts.values()):
                chunk: dict[str, Any] = {"input": i, "text": text, "tokens": n - sent[i]}
                if not sent[i]:  # its first delta
                    chunk["prompt_tokens"] = len(s.prompt)
                    if r.spec.token_ids:  # each choice's stream begins with them (vLLM's)
                        chunk["prompt_token_ids"] = list(s.prompt)
                    chunk |= self._prompt_echo(r, i)
                if r.spec.sampling.logprobs is not None:
                    chunk["logprobs"] = self._logprobs(self.engine.logprobs(s.name)[sent[i] : n])
                if r.spec.token_ids:
                    chunk["token_ids"] = s.text.tokens[sent[i] : n]
                out.append(Partial(r.key, chunk | parts))
                sent[i] = n
        return out

    def _prompt_echo(self, r: _Req, i: int) -> dict[str, Any]:
        """What the first delta of output ``i`` carries of its prompt for a stream to echo
        it first: the first output of each input, its ``prompt_text`` and ``prompt_logprobs``
        as asked (its prefill is done: it generated)."""
        if i % r.spec.n:
            return {}
        out: dict[str, Any] = {}
        if r.spec.prompt_texts is not None:
            out["prompt_text"] = r.spec.prompt_texts[i // r.spec.n]
        s = r.seqs[i]
        if s.score is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(s)
        return out

    def _progress(self, r: _Req) -> Progress:
        if r.beams is not None:
            ctx, left = r.beams.contexts()
            return Progress(ctx, (0,) * len(ctx), left)
        contexts: list[int] = []
        prefill: list[int] = []
        for s in r.seqs:
            if s.finish is not None:
                continue
            st = self.engine.state(s.name)
            if st is None:  # queued this step, not yet in the engine
                contexts.append(0)
                prefill.append(len(s.prompt) + len(s.text.tokens))
            else:
                contexts.append(st.context)
                prefill.append(st.prefill_left)
        left = max((s.max_new - len(s.text.tokens) for s in r.seqs if s.finish is None), default=0)
        return Progress(tuple(contexts), tuple(prefill), left)

    def _out_of_memory(
        self, failure: str, events: list[StepEvent], report: StepReport
    ) -> StepReport:
        """A step ran out of memory: while the step budget can still shrink, every running
        request is preempted (its text kept, resumed by recomputation) and the per-step
        token budget halves (activations are what grows with it; the KV cache is allocated
        up front); after that, as any failed step."""
        running = self._stop_engine()
        release_cached_memory(self.torch_device)
        report.out_of_memory = True
        if self.step_tokens <= self.page_size:
            logger.error("generation step out of memory at the smallest step budget (%d "
                         "running): %s", len(running), failure)  # fmt: skip
            return self._fail(running, f"generation step failed: {failure}", events, report)
        self.step_tokens = max(self.page_size, self.step_tokens // 2)
        self.engine.set_step_tokens(self.step_tokens)
        logger.warning("out of memory in a generation step: %d requests preempted, step "
                       "budget now %d tokens", len(running), self.step_tokens)  # fmt: skip
        events += [self._park(r) for r in running]
        report.events = events
        return report

    def _failed_step(
        self, exc: Exception, events: list[StepEvent], report: StepReport
    ) -> StepReport:
        """A step failed (not for memory): every running request fails (a generation cannot
        be bisected mid-way) and the engine starts clean."""
        running = self._stop_engine()
        logger.error("generation step failed (%d running): %s", len(running), exc, exc_info=exc)
        message = f"generation step failed: {type(exc).__name__}: {exc}"
        return self._fail(running, message, events, report)

    def _stop_engine(self) -> list[_Req]:
        """Empty the engine after a failed step; the requests that were running."""
        running = [r for r in self._reqs.values() if not r.parked]
        self.engine.reset()
        for r in running:  # the engine holds nothing now: nothing to cancel in it
            for seq in r.seqs:
                self._by_seq.pop(seq.name, None)
            if r.beams is not None:
                self._beam_cancel(r)
        return running

    def _fail(
        self, running: list[_Req], message: str, events: list[StepEvent], report: StepReport
    ) -> StepReport:
        for r in running:
            events.append(Failed(r.key, message, ErrorCode.INFERENCE_FAILED))
            self._reqs.pop(r.key, None)
            for seq in r.seqs:
                self.engine.forget(seq.name)
        report.events = events
        return report

    def _marked(self, markers: tuple[str, ...]) -> Decode:
        """The decode for texts that parsers read for ``markers`` (see :meth:`_keeping`)."""
        if not markers:
            return self._decode
        if markers not in self._decodes:
            self._decodes[markers] = self._keeping(markers) or self._decode
        return self._decodes[markers]

    def _keeping(self, markers: Sequence[str]) -> Decode | None:
        """A decode that keeps those of ``markers`` this tokenizer makes special tokens
        (and skips the other special tokens; :data:`_ALL_SPECIAL`: keeps all but the
        end-of-sequence ones); None where none of them is one."""
        tok = self.tokenizer
        special = set(tok.all_special_ids)
        special |= {i for i, t in tok.added_tokens_decoder.items() if t.special}
        if markers == _ALL_SPECIAL:  # skip_special_tokens false
            keep = special - set(self.eos)
        else:
            # an end-of-sequence marker (harmony's <|return|>, <|call|>) ends the text
            keep = {i for i in special if tok.convert_ids_to_tokens(i) in markers} - set(self.eos)
        if not keep:
            return None
        drop = frozenset(special - keep)
        decode = self._backend_decode or tok.decode

        def decode_keeping(ids: Sequence[int]) -> str:
            text: str = decode([i for i in ids if i not in drop], skip_special_tokens=False)
            return text

        return decode_keeping

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            fast: str = self._backend_decode(ids, skip_special_tokens=True)
            return fast
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def info(self) -> dict[str, Any]:
        return {
            "runner": self.name, "engine": self.engine_kind, "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."), "context": self.context,
            "kv_cache_tokens": self.kv_cache_tokens, "page_size": self.page_size,
            "step_tokens": self.step_tokens, "max_running": self.max_running,
            "compile_threads": self.compile_threads,
            "decode": "lean" if getattr(self.engine, "lean", None) is not None else "transformers",
            "running": len(self._reqs),
            "structured_outputs": not isinstance(self._grammars, str),
            "tool_call_parser": self.tool_call_parser,
            "reasoning_parser": self.reasoning_parser,
            "reasoning_markers": None if self._markers is None
            else [self._markers.start_str, self._markers.end_str],
            "lora_adapters": list(self.lora_adapters), "max_loras": self.max_loras,
            "sampling_defaults": self.sampling_defaults.sampling,
            **self._resident(),
        }  # fmt: skip

    def _resident(self) -> dict[str, Any]:
        """The padded engine's prompt tokens run and taken from a twin's prefill (a
        request's ``n`` completions); with a prefix cache, the tokens it holds and those
        prompts found there; on CPU, tokens its KV rows hold written, bytes released. The
        paged engine's prompt tokens taken from shared blocks."""
        from ..generation.draft import DraftProposer
        from ..generation.padded import PaddedEngine
        from ..generation.paged import PagedEngine

        e = self.engine
        if isinstance(e, PagedEngine):  # its shared blocks' hits
            return {"prefix_cache_hit_tokens": e.sharing.hit_tokens} if e.sharing.on else {}
        if not isinstance(e, PaddedEngine):
            return {}
        out: dict[str, Any] = {"prefill_tokens": e.prefilled, "prefill_shared_tokens": e.shared}
        if e.speculative is not None:
            if isinstance(draft := e.speculative, DraftProposer):
                out.update(draft_kv_tokens=draft.tokens, draft_prefill_tokens=draft.prefilled,
                           draft_prefill_shared_tokens=draft.shared)  # fmt: skip
            out.update(speculative=e.speculative.settings(),
                       spec_decode_drafts=e.drafted[0], spec_decode_draft_tokens=e.drafted[1],
                       spec_decode_accepted_tokens=sum(e.accepted))  # fmt: skip
        if e.prefix is not None:
            out.update(prefix_cache_tokens=e.prefix.tokens,
                       prefix_cache_hit_tokens=e.prefix.hit_tokens)  # fmt: skip
        if e.resident_tokens is not None:
            out.update(kv_resident_tokens=e.resident, kv_released_bytes=e.released_bytes)
        return out
