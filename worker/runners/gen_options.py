"""The text-generation runner's options that are values, read and checked at startup: the
scheduler's budgets, the sampling defaults, and the parsers that read the model's text
(tool calls, reasoning, the formats some models write their answers in).

A bad value is a ``ValueError`` that names the option, raised before the engine is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..generation import blocks as block_formats
from ..generation import cohere, defaults, hy_v4
from ..generation.reasoning import REASONING_PARSERS, reasoning_for
from ..generation.think_budget import Markers, markers
from ..generation.tools import PARSERS
from .gen_state import RunnerState


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


class Options(RunnerState):
    """The options read into the runner's attributes (documented where they are set)."""

    def _read_budgets(self, opts: dict[str, Any]) -> None:
        """The scheduler's and engine's sizes (``page_size``, ``kv_cache_tokens``,
        ``step_tokens``, ``max_running``) and the constraint compiler's threads."""
        self.page_size = int(opts.get("page_size", 32))
        self.kv_cache_tokens = int(opts.get("kv_cache_tokens", 16384))
        self.step_tokens = int(opts.get("step_tokens", 512))
        self.max_running = int(opts.get("max_running", 64))
        self.compile_threads = int(opts.get("compile_threads", 1))
        if not 0 <= self.compile_threads <= 16:
            raise ValueError(f"options.compile_threads: {self.compile_threads} is not 0 … 16")

    def _read_defaults(self, path: str | Path, opts: dict[str, Any]) -> None:
        """The sampling defaults and the cap on ``max_new_tokens`` (vLLM's
        ``--generation-config`` and ``--override-generation-config``)."""
        self.sampling_defaults = defaults.load(
            path,
            opts.get("generation_config", "vllm"),
            opts.get("override_generation_config"),
            opts.get("gguf_file"),
        )
        """Sampling defaults for the fields a request leaves unset (``generation_config``,
        ``override_generation_config``: :mod:`..generation.defaults`)."""
        if "max_new_tokens" in opts and "max_new_tokens" in self.sampling_defaults.overridden:
            raise ValueError("options.max_new_tokens and override_generation_config's "
                             "max_new_tokens: set one")  # fmt: skip
        self.new_tokens_cap = self.sampling_defaults.cap
        """The most tokens any request generates, its own ``max_new_tokens`` cut to it
        (the generation config's where vLLM makes it a bound: ``SamplingDefaults.cap``)."""

    def _read_parsers(self, opts: dict[str, Any]) -> None:
        """``tool_call_parser``, ``reasoning_parser`` and ``reasoning_config`` checked, and
        the reasoning split and ``thinking_token_budget`` markers built for this vocabulary."""
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

    def _read_formats(self) -> None:
        """The message format the parsers say the model writes (harmony, Cohere's, message
        blocks), and so how its calls are read."""
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
