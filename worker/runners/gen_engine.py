"""Which engine serves the text-generation runner's model, and building it: ``padded``
where every layer attends to the whole context, else transformers' ``paged`` engine
(:func:`why_windowed`); the padded engine's prefix cache, KV cache dtype and speculation.

Startup only: nothing here runs per request or per step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..generation.speculative import DraftConfig, NgramConfig, Proposer, parse
from .gen_options import flag
from .gen_state import RunnerState

if TYPE_CHECKING:
    from ..generation.engine import Engine
    from ..generation.lora import Adapter

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16}
"""``options.kv_cache_dtype`` values (vLLM's ``--kv-cache-dtype``; ``auto``: the model's
dtype) and the dtype each keeps keys and values in. No fp8: the padded engine's attention
reads float32 or bfloat16."""


def why_windowed(config: Any, context: int) -> str | None:
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


class EngineSetup(RunnerState):
    """The engine picked for the model and built from the options."""

    def _pick_engine(self, cfg: Any, opts: dict[str, Any]) -> None:
        """``options.engine`` read against the model (``cfg``, its text config): ``auto``
        picks the padded engine where it serves the model; ``padded`` for a model it does
        not serve is an error. Then ``prefix_cache_tokens``, which only ``padded`` takes."""
        windowed = why_windowed(cfg, self.context)
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
        self._read_kv_cache_dtype(opts.get("kv_cache_dtype", "auto"), windowed)

    def _read_kv_cache_dtype(self, value: Any, windowed: str | None) -> None:
        """``options.kv_cache_dtype`` checked: ``auto`` (the model's dtype) or ``bfloat16``,
        which only the padded engine takes (transformers' paged engine keeps its cache in
        the model's dtype) where it is not the model's."""
        if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
            raise ValueError(f"options.kv_cache_dtype: {value!r} is not one of "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")  # fmt: skip
        dtype = KV_CACHE_DTYPES[value] or self.dtype
        if dtype != self.dtype and self.engine_kind != "padded":
            why = f" (this model {windowed})" if windowed else ""
            raise ValueError(f"options.kv_cache_dtype: {value!r} needs the padded engine, and "
                             f"this model runs on the paged engine{why}, whose cache has the "
                             f"model's dtype ({str(self.dtype).removeprefix('torch.')})")  # fmt: skip
        self.kv_cache_dtype = dtype

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

    def _make_engine(self, opts: dict[str, Any], adapters: tuple[Adapter, ...]) -> Engine:
        """The engine of :attr:`engine_kind`, with the LoRA ``adapters`` loaded at startup
        (an unknown ``options.engine`` is an error here, once the others are checked)."""
        if self.engine_kind == "padded":
            return self._padded_engine(opts, adapters)
        if self.engine_kind == "paged":
            return self._paged_engine(opts, adapters)
        raise ValueError(f"options.engine: {self.engine_kind!r} is not 'auto', 'padded' or "
                         "'paged'")  # fmt: skip

    def _padded_engine(self, opts: dict[str, Any], adapters: tuple[Adapter, ...]) -> Engine:
        """The padded engine, with its prefix cache (``prefix_cache_tokens``), lean decode
        (``lean_decode``) and speculation's proposer."""
        from ..generation.padded import PaddedEngine
        from ..generation.prefix_cache import PrefixCache

        prefix = None
        if self.prefix_cache_tokens:
            prefix = PrefixCache(self.prefix_cache_tokens, self.page_size)
        lean = flag(opts.get("lean_decode", True), "lean_decode")
        return PaddedEngine(self.model, eos_token_ids=self.eos,
                            step_tokens=self.step_tokens, max_running=self.max_running,
                            lean=lean,
                            max_context=self.context,
                            resident_tokens=self.kv_cache_tokens,
                            prefix_cache=prefix, adapters=adapters,
                            speculative=self._proposer(lean),
                            seed=self.seed, kv_cache_dtype=self.kv_cache_dtype)  # fmt: skip

    def _paged_engine(self, opts: dict[str, Any], adapters: tuple[Adapter, ...]) -> Engine:
        """Transformers' paged engine: ``kv_cache_tokens`` in blocks of ``page_size``, its
        steps replayed as CUDA graphs where ``cuda_graphs`` says so."""
        from ..generation.paged import PagedEngine

        pad = self.tokenizer.pad_token_id
        blocks = -(-self.kv_cache_tokens // self.page_size)
        return PagedEngine(
            self.model,
            eos_token_ids=self.eos,
            pad_token_id=int(pad if pad is not None else (self.eos[0] if self.eos else 0)),
            # One spare block per sequence beyond the scheduler's budget: the engine
            # takes a sequence's next block a little ahead of its use.
            kv_blocks=blocks + self.max_running,
            page_size=self.page_size,
            step_tokens=self.step_tokens,
            max_running=self.max_running,
            cuda_graphs=flag(opts.get("cuda_graphs", False), "cuda_graphs"),
            adapters=adapters,
            seed=self.seed,
        )

    def _proposer(self, lean: bool) -> Proposer | None:
        """The padded engine's proposer: the n-gram config, or the draft model loaded
        (:func:`.draft.load`: a ``ValueError`` where its vocabulary is not the model's;
        ``lean``: ``lean_decode``, for its forwards too; at the model's
        ``matmul_precision``)."""
        if not isinstance(self.speculative, DraftConfig):
            return self.speculative
        from ..generation import draft

        return draft.load(self.speculative, self.model, self.step_tokens, self.context, lean,
                          self.matmul_precision)  # fmt: skip
