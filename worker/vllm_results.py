"""What vLLM's per-request metrics count of a batch of results (:class:`Gathered`), read
off the results once so that :class:`~.vllm_metrics.VllmObserver` updates each series
once a batch instead of a dozen times a result."""

from __future__ import annotations

from collections import Counter as Tally
from typing import Any, NamedTuple

from ..schemas.errors import ErrorCode
from ..schemas.messages import Result
from .observers import Reply

ABORTED = {"deadline": "abort", "cancelled": "abort"}
"""Our ``finish_reason`` values vLLM names otherwise (``stop`` and ``length`` are the same)."""
ENGINE_ERRORS = frozenset({ErrorCode.INFERENCE_FAILED, ErrorCode.POISONED, ErrorCode.INTERNAL})
"""Error results vLLM would count as ``finished_reason="error"`` (a request that failed in
the engine); a bad request is refused before vLLM's engine and is not counted."""
PHASES = ("e2e", "queue", "inference", "prefill", "decode")
"""vLLM's phase histograms (``vllm:request_<phase>_time_seconds``, e2e's its own name)."""


class Gathered:
    """A batch of results' counts (counters' increments, summed) and observations (each
    histogram's values, in the order one result at a time observes them)."""

    def __init__(self) -> None:
        self.prompted = False
        """Some result told its prompt tokens (the prompt counters are updated)."""
        self.prompt = self.cached = self.recomputed = 0
        self.recomputing = False
        """Some result had a recomputed prompt token (its counter is updated)."""
        self.success: Tally[str] = Tally()
        """vLLM's engine requests finished, by ``finished_reason``, in first-seen order."""
        self.params_n: list[float] = []
        self.most_generated: list[float] = []
        self.prompt_tokens: list[float] = []
        self.generation_tokens: list[float] = []
        self.prefill_computed: list[float] = []
        self.max_tokens: list[float] = []
        self.ttft: list[float] = []
        self.per_output_token: list[float] = []
        self.phases: dict[str, list[float]] = {name: [] for name in PHASES}

    def add(self, reply: Reply) -> None:
        """One result, as vLLM counts it: its prompt tokens; an engine error's or an
        expiry's requests; else each input's ``n`` and each output's tokens and times."""
        res = reply.result
        outputs = [_counts(o) for o in res.outputs or ()]
        if (prompted := _prompted(outputs, res)) is not None:
            prompt, cached, recomputed = prompted
            self.prompted = True
            self.prompt += prompt
            self.cached += cached
            self.recomputed += recomputed
            self.recomputing = self.recomputing or bool(recomputed)
        if res.status == "error":
            code = res.error.code if res.error is not None else None
            if code in ENGINE_ERRORS:
                self.success["error"] += _outputs_asked(reply)
            return
        if res.status != "ok":  # expired: its deadline passed before it ran
            self.success["abort"] += _outputs_asked(reply)
            return
        request = reply.request
        n = (request.n if request is not None else None) or 1
        for first in range(0, len(outputs), n):  # an input's n completions
            self.params_n.append(n)
            self.most_generated.append(
                max(out.completion_tokens for out in outputs[first : first + n])
            )
        max_tokens = request.max_new_tokens if request is not None else None
        phases = _phases(res)
        for out in outputs:
            self.success[ABORTED.get(out.finish_reason, out.finish_reason)] += 1
            self.prompt_tokens.append(out.prompt_tokens)
            self.generation_tokens.append(out.completion_tokens)
            self.prefill_computed.append(out.prompt_tokens - max(out.cached_tokens, 0))
            if max_tokens is not None:
                self.max_tokens.append(max_tokens)
            if phases is not None:
                self._timed(out, phases)

    def _timed(self, out: _Output, phases: dict[str, float]) -> None:
        """An output's latencies: its request's (they run, and are answered, together)."""
        self.ttft.append(phases["ttft"])
        for name, values in self.phases.items():
            values.append(phases[name])
        tokens = out.completion_tokens
        self.per_output_token.append(phases["decode"] / (tokens - 1) if tokens > 1 else 0.0)


class _Output(NamedTuple):
    """What the metrics read of one output."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def _counts(output: Any) -> _Output:
    """An output's finish reason and token counts, read off its map (the worker's) or its
    :class:`Generation`, without validating the rest (its logprobs may be long)."""
    get = output.get if isinstance(output, dict) else lambda k, d=None: getattr(output, k, d)
    return _Output(str(get("finish_reason", "stop")), int(get("prompt_tokens", 0) or 0),
                   int(get("completion_tokens", 0) or 0),
                   int(get("cached_tokens", 0) or 0))  # fmt: skip


def _prompted(outputs: list[_Output], res: Result) -> tuple[int, int, int] | None:
    """A request's prompt tokens, cached ones, and recomputed ones (a prompt cached but for
    its last token, prefilled again for its logits: one, vLLM's rule) as vLLM counts them:
    per output, each of an input's ``n`` completions one of its engine's requests with its
    prompt (prefilled, or cached after its twin's); from the usage (each prompt once)
    where the outputs tell no prompt tokens (a custom runner's); None without either."""
    if any(out.prompt_tokens for out in outputs):
        return (sum(out.prompt_tokens for out in outputs),
                sum(out.cached_tokens for out in outputs),
                sum(1 for out in outputs
                    if out.cached_tokens and out.cached_tokens + 1 == out.prompt_tokens))  # fmt: skip
    if res.usage is None:
        return None
    details = res.usage.prompt_tokens_details
    return res.usage.prompt_tokens, details.cached_tokens if details is not None else 0, 0


def _phases(res: Result) -> dict[str, float] | None:
    """vLLM's phases of a request, in seconds, from its timings: queue (enqueued to first
    scheduled: read, then admitted to a step), prefill (to its first token), decode (to
    its last), inference (prefill + decode), e2e (to its result); None without a first
    token (nothing generated)."""
    t = res.timings
    if t.first_token_ms is None:
        return None
    queue = (t.queued_ms + t.batch_wait_ms) / 1000
    inference = t.inference_ms / 1000
    prefill = min(max(0.0, t.first_token_ms / 1000 - queue), inference)
    return {"ttft": t.first_token_ms / 1000, "e2e": t.total_ms / 1000, "queue": queue,
            "inference": inference, "prefill": prefill, "decode": inference - prefill}  # fmt: skip


def _outputs_asked(reply: Reply) -> int:
    """The outputs a request asked for (inputs x ``n``): vLLM's engine requests."""
    req = reply.request
    return 1 if req is None else max(1, len(req.inputs)) * (req.n or 1)
