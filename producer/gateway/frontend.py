"""vLLM's frontend switches of the chat and completion answers, as the gateway serves
them: the chat answer's role (``--response-role``), ``system_fingerprint``
(``--fingerprint-mode``, ``--fingerprint-value``: :mod:`.fingerprint`), usage in every stream
(``--enable-force-include-usage``), tools kept out of the chat template where
``tool_choice`` is none (``--exclude-tools-when-tool-choice-none``) and per-request
timing metrics (``--enable-per-request-metrics``); and whether ``/tokenizer_info`` is
served (``--enable-tokenizer-info-endpoint``, :mod:`.tokenizer_info`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...schemas.messages import Result


@dataclass(frozen=True, slots=True)
class Frontend:
    """The switches, vLLM's defaults by default."""

    response_role: str = "assistant"
    """A chat answer's role where the request adds the generation prompt (its default)."""
    system_fingerprint: str | None = None
    """``--fingerprint-value``: whole answers' ``system_fingerprint`` in ``custom`` mode
    (streamed chunks never carry one, as vLLM's)."""
    force_include_usage: bool = False
    """Every stream ends with the usage chunk, as if ``stream_options.include_usage``."""
    exclude_tools_when_tool_choice_none: bool = False
    """A request whose ``tool_choice`` is ``none`` reaches the template without its tools."""
    per_request_metrics: bool = False
    """One-output answers carry ``metrics`` (streamed: in the usage chunk)."""
    tokenizer_info: bool = False
    """``GET /tokenizer_info`` is served (it shows the chat template)."""
    fingerprint_mode: str = "full"
    """vLLM's ``--fingerprint-mode``: ``full``, ``hash``, ``custom`` or ``none``
    (:mod:`.fingerprint`)."""
    data_parallel_size: int = 1
    """vLLM's ``--data-parallel-size``: the replicas the fleet is deployed with, named in
    ``full`` fingerprints (``dpN`` where > 1), as vLLM's configured one is: fixed, so the
    fingerprint stays as workers come and go."""


def chat_role(body: Mapping[str, Any], frontend: Frontend) -> str:
    """vLLM's ``get_chat_request_role``: the response role, or, where the request asks for
    no generation prompt (the model continues the last message), that message's role."""
    messages = body.get("messages")
    if body.get("add_generation_prompt") is not False or not isinstance(messages, list):
        return frontend.response_role
    last = messages[-1] if messages else None
    role = last.get("role") if isinstance(last, Mapping) else None
    return role if isinstance(role, str) else frontend.response_role


def stream_usage(body: Mapping[str, Any], frontend: Frontend) -> tuple[bool, bool]:
    """vLLM's ``should_include_usage``: whether the stream ends with its usage, and whether
    every chunk carries the usage so far (``continuous_usage_stats``, with the first)."""
    options = body.get("stream_options")
    if not isinstance(options, Mapping):
        return frontend.force_include_usage, False
    usage = bool(options.get("include_usage")) or frontend.force_include_usage
    return usage, usage and bool(options.get("continuous_usage_stats"))


def without_tools(options: dict[str, Any], frontend: Frontend) -> dict[str, Any]:
    """A fleet request's ``options`` without its ``tools`` where its ``tool_choice`` is
    ``none`` and the switch is on: the template renders no tool definitions (the worker
    calls none either way)."""
    if not (frontend.exclude_tools_when_tool_choice_none and options.get("tool_choice") == "none"
            and "tools" in options):  # fmt: skip
        return options
    return {k: v for k, v in options.items() if k != "tools"}


def timing_metrics(result: Result) -> dict[str, float | None] | None:
    """vLLM's ``PerRequestTimingMetrics`` of a one-output generation (None otherwise, as
    vLLM's: several prompts or ``n`` > 1), from its timings (ms from enqueue): vLLM's
    moments as the worker records them: scheduled at its first step's start, its first
    token at the end of the step that generated it, its last at the end of its last step
    (docs/gateway.md says where they differ). A field whose moments are unknown (nothing
    generated) is null."""
    gens = result.generations() if result.outputs else []
    if len(gens) != 1:
        return None
    t, tokens = result.timings, gens[0].completion_tokens
    scheduled = t.queued_ms + t.batch_wait_ms
    last = scheduled + t.inference_ms
    first = t.first_token_ms
    decode = None if first is None else max(0.0, last - first)
    return {
        "time_to_first_token_ms": None if first is None else max(0.0, first - scheduled),
        "generation_time_ms": decode,
        "queue_time_ms": scheduled,
        "mean_itl_ms": decode / (tokens - 1) if decode is not None and tokens > 1 else None,
        "tokens_per_second": tokens / t.inference_ms * 1000
        if first is not None and t.inference_ms > 0 else None,
    }  # fmt: skip
