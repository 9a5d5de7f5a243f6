"""What the text-generation runner's constructor loads and reads off the model: its
tokenizer (with the chat template options) and weights, the context and end-of-sequence
tokens, a reasoning parser's markers as tokens, the LoRA adapters of its options, and the
structured-output compiler.

Startup only: nothing here runs per request or per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import precision
from ..generation.chat_template import ChatTemplates
from ..generation.grammar import Grammars
from ..generation.lora_table import MAX_LORAS, AdapterTable
from ..generation.reasoning import Reasoning
from ..generation.sampling import Marker
from .gen_state import RunnerState

if TYPE_CHECKING:
    from ..generation.lora import Adapter

logger = logging.getLogger(__name__)


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of the one token ``text`` is (None: it takes more, or none)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def answer_marker(tokenizer: Any, split: Reasoning) -> Marker | None:
    """A reasoning parser's :attr:`~Reasoning.answer_marker` as tokens (None: its tags
    are not tokens of their own, so a text could write them otherwise)."""
    tag, word, tail = split.answer_marker
    first = single_token(tokenizer, tag)
    if first is None:
        return None
    if not word and not tail:
        return Marker((first,))
    head = [int(t) for t in tokenizer.encode(tag + word, add_special_tokens=False)]
    last = single_token(tokenizer, tail)
    if head[:1] != [first] or last is None:
        return None
    return Marker(tuple(head), (last,), gap=MARKER_GAP)


MARKER_GAP = 20
"""Tokens allowed between a marker's head and tail (vLLM's for gpt-oss: a
``<|constrain|>json`` there)."""


def gguf_args(opts: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained``'s arguments for ``options.gguf_file`` (none where unset)."""
    gguf = opts.get("gguf_file")
    return {"gguf_file": gguf} if gguf else {}


class Setup(RunnerState):
    """The runner's model, tokenizer and the pieces built from them at startup."""

    def _load_tokenizer(self, path: str | Path, opts: dict[str, Any]) -> None:
        """The tokenizer (``gguf_file``: from that file in ``path``), with the chat
        template options applied: read and checked before the weights load."""
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), **gguf_args(opts))
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
        cleanup (off here), at a quarter of the cost; a step decodes two windows per token
        (the first, mostly one token, kept: :meth:`~.gen_outputs.Outputs._decode`)."""

    def _load_model(self, path: str | Path, opts: dict[str, Any]) -> None:
        """The weights (``gguf_file``: from that file), in :attr:`dtype` on
        :attr:`torch_device`, in eval mode, at ``matmul_precision`` (checked first)."""
        wanted = precision.read(opts.get("matmul_precision"))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype,
                                                     **gguf_args(opts))  # fmt: skip
        self.model = model.to(self.torch_device).eval()
        self.matmul_precision = precision.apply(self.model, wanted, self.torch_device,
                                                "the model")  # fmt: skip
        """The precision of its linear layers' products in effect (:mod:`..precision`)."""

    def _read_limits(self, cfg: Any, max_tokens: int) -> None:
        """The context (the model's positions, at most ``kv_cache_tokens``), the longest
        prompt (``max_tokens``, 0: the context's), the vocabulary and the end-of-sequence
        tokens (the generation config's and the tokenizer's)."""
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

    def _load_loras(self, opts: dict[str, Any]) -> tuple[Adapter, ...]:
        """``lora_adapters`` loaded (:meth:`_adapters`) and the table of adapters requests
        may name, ``max_loras`` at once: the adapters, for the engine."""
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
        return adapters

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

    def _read_think_tokens(self) -> None:
        """The reasoning parser's tags as this tokenizer's tokens, where a chat's
        constraint begins (none without a reasoning parser)."""
        self._think_end = (
            None if self._reasoning is None else answer_marker(self.tokenizer, self._reasoning)
        )
        """The tokens after which a reasoning chat's constraint begins (``</think>``;
        gpt-oss's ``<|channel|>final`` … ``<|message|>``; None: its tags are not tokens
        of their own, or no reasoning parser)."""
        self._think_open = (
            None if self._reasoning is None else single_token(self.tokenizer, self._reasoning.open)
        )
        """The opening tag's token: where the prompt leaves it to the model whether to
        think, a constraint holds from the first token unless that is this one."""

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
