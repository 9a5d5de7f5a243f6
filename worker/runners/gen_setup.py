"""What the text-generation runner's constructor reads off the model and its options: a
reasoning parser's markers as tokens, whether every layer attends to the whole context
(which engine serves it), boolean options, and the pieces it builds from options
(speculation, LoRA adapters, the structured-output compiler).

Startup only: nothing here runs per request or per step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..generation.grammar import Grammars
from ..generation.reasoning import Reasoning
from ..generation.sampling import Marker
from ..generation.speculative import DraftConfig, NgramConfig, Proposer, parse
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


def flag(value: Any, name: str) -> bool:
    """A boolean option (TOML gives a bool; anything else is refused, not guessed)."""
    if not isinstance(value, bool):
        raise ValueError(f"options.{name}: {value!r} is not true or false")
    return value


def seed_option(value: Any) -> int | None:
    """``options.seed`` checked (vLLM's ``--seed``): the seed of the stream sampled
    requests without a seed of their own take theirs from (None: unset, random)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise ValueError(f"options.seed: {value!r} is not an integer 0 … 2**63 - 1")
    return value


class Setup(RunnerState):
    """The runner's pieces built from its options at startup."""

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
