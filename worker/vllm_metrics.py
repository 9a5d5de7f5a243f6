"""vLLM's Prometheus metrics (``vllm:*``) for the generating models of a worker, so that
vLLM's Grafana dashboard and alerts work on the fleet.

Names, types, label names and buckets are those of vLLM's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``). Each series is fed by the same loop event as its
``batchfleet_*`` twin in :mod:`.metrics` (:class:`VllmObserver` sits beside
:class:`~.metrics.PrometheusObserver`), or read off the runners at scrape time
(:class:`~.vllm_info.VllmInfoCollector`). ``model_name`` is the fleet's model name (what
``/v1/models`` lists); ``engine`` is always ``"0"`` (one engine per model per worker;
the scrape's ``instance`` tells workers apart). docs/operations.md lists the differences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..schemas.errors import ErrorCode
from ..schemas.messages import Result
from .observers import Answered, Generated, LoopEvent, Reply
from .token_gaps import TokenGaps

ENGINE = "0"
LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``FINISH_REASON_STRINGS``: each ``vllm:request_success_total`` series exists
from the start."""
ABORTED = {"deadline": "abort", "cancelled": "abort"}
"""Our ``finish_reason`` values vLLM names otherwise (``stop`` and ``length`` are the same)."""
ENGINE_ERRORS = frozenset({ErrorCode.INFERENCE_FAILED, ErrorCode.POISONED, ErrorCode.INTERNAL})
"""Error results vLLM would count as ``finished_reason="error"`` (a request that failed in
the engine); a bad request is refused before vLLM's engine and is not counted."""
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's ``PromptTokenStats.ALL_SOURCES`` (no KV transfer here: it stays 0)."""
WAITING_REASONS = ("capacity", "deferred")
"""vLLM's: ``capacity`` waits for room (KV cache, running slots, the step's budget);
``deferred`` is blocked meanwhile (here: its structured-output constraint compiling)."""
MAX_TOKEN_COUNT = 1_000_000
"""vLLM's token-count buckets go 1, 2, 5, 10 ... up to ``max_model_len``; one family here
serves every model of the worker, so they go up to this (the longest contexts)."""


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50 ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


TOKEN_COUNT_BUCKETS = buckets_1_2_5(MAX_TOKEN_COUNT)


class VllmMetrics:
    """The ``vllm:*`` families of one worker, in its registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = list(LABELS)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Any:
            return Counter(name, doc, [*labels, *extra], registry=registry)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")  # fmt: skip
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")  # fmt: skip
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA "
            "budget, KV transfer, blocked status). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            [*labels, "reason"], registry=registry,
        )  # fmt: skip
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")  # fmt: skip
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use "
            "vllm:kv_cache_usage_perc instead.",
        )
        """Deprecated names (vLLM hides them since 0.11) that vLLM's example Grafana
        dashboard still plots: the same values as their new names'."""
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"]
        )
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.prompt_recomputed = counter(
            "vllm:prompt_tokens_recomputed",
            "Number of cached prompt tokens recomputed for forward pass.",
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.",
            ["finished_reason"],
        )  # fmt: skip
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
            TOKEN_COUNT_BUCKETS,
        )  # fmt: skip
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            TOKEN_COUNT_BUCKETS,
        )  # fmt: skip
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_BUCKETS,
        )  # fmt: skip
        self.prefill_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            TOKEN_COUNT_BUCKETS,
        )
        self.max_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            TOKEN_COUNT_BUCKETS,
        )
        """Per input, the most tokens one of its ``n`` completions generated (vLLM's
        parallel-sampling stat, despite its documentation)."""
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            TOKEN_COUNT_BUCKETS,
        )  # fmt: skip
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.inter_token = TokenGaps(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            LABELS, ITL_BUCKETS,
            aliases=[("vllm:time_per_output_token_seconds",
                      "Histogram of time per output token in seconds. DEPRECATED: Use "
                      "vllm:inter_token_latency_seconds instead.")],
        )  # fmt: skip
        registry.register(self.inter_token)
        self.time_per_output_token = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        phases = {
            "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            "inference": ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
            "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
        }  # fmt: skip
        self.phases = {k: hist(n, d, REQUEST_LATENCY_BUCKETS) for k, (n, d) in phases.items()}
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")  # fmt: skip
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")  # fmt: skip
        self.spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.spec_accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", ["position"],
        )  # fmt: skip

    def init_model(self, model: str) -> None:
        """Create a generating model's series at 0, as vLLM does at its start."""
        for family in (self.running, self.waiting, self.kv_usage, self.gpu_cache_usage,
                       self.prefix_queries, self.prefix_hits, self.preemptions,
                       self.prompt_tokens, self.prompt_cached, self.prompt_recomputed,
                       self.generation_tokens, self.request_prompt_tokens,
                       self.request_generation_tokens, self.max_generation_tokens,
                       self.iteration_tokens, self.prefill_kv_computed,
                       self.params_n, self.params_max_tokens, self.ttft,
                       self.time_per_output_token, *self.phases.values()):  # fmt: skip
            family.labels(model, ENGINE)
        for reason in FINISHED_REASONS:
            self.success.labels(model, ENGINE, reason)
        for source in PROMPT_SOURCES:
            self.prompt_by_source.labels(model, ENGINE, source)
        for reason in WAITING_REASONS:
            self.waiting_by_reason.labels(model, ENGINE, reason)


class VllmObserver:
    """Feeds :class:`VllmMetrics` from the loop's events, for generating models only: one
    whose fleet entry runs ``text-generation``, or any that reports a step."""

    def __init__(self, metrics: VllmMetrics, model: str, generating: bool) -> None:
        self.m = metrics
        self.model = model
        self.generating = False
        self._steps: dict[str, _StepSeries] = {}
        if generating:
            self._start()

    def _start(self) -> None:
        self.generating = True
        self.m.init_model(self.model)

    def notify(self, event: LoopEvent) -> None:
        if isinstance(event, Generated):
            if not self.generating:
                self._start()
            self._generated(event)
        elif isinstance(event, Answered) and self.generating:
            for reply in event.replies:
                self._answered(reply)

    def _step_series(self, model: str) -> _StepSeries:
        """The series every step sets (looking a labelled child up costs about 1 µs)."""
        series = self._steps.get(model)
        if series is None:
            m, labels = self.m, (model, ENGINE)
            series = self._steps[model] = _StepSeries(
                m.running.labels(*labels), m.waiting.labels(*labels),
                m.waiting_by_reason.labels(*labels, "capacity"),
                m.waiting_by_reason.labels(*labels, "deferred"),
                m.kv_usage.labels(*labels), m.gpu_cache_usage.labels(*labels),
                m.iteration_tokens.labels(*labels), m.generation_tokens.labels(*labels),
            )  # fmt: skip
        return series

    def _generated(self, e: Generated) -> None:
        m, labels = self.m, (e.model, ENGINE)
        step = self._step_series(e.model)
        # vLLM's scheduler keeps a request whose constraint compiles waiting (skipped):
        # counted in num_requests_waiting, by the reason "deferred", not as running; and
        # one that a later step admits (planned already) waits until that step runs it
        # (vLLM's parallel sampling makes each of a request's n completions a request)
        queued = e.waiting if e.waiting_sequences is None else e.waiting_sequences
        step.running.set(e.running - e.deferred - e.admitting)
        step.waiting.set(queued + e.admitting + e.deferred)
        step.capacity.set(queued + e.admitting)
        step.deferred.set(e.deferred)
        step.iteration_tokens.observe(e.prefilled + e.tokens)
        usage = e.kv_tokens / max(1, e.kv_capacity)
        step.kv_usage.set(usage)
        step.gpu_cache_usage.set(usage)
        if e.preempted:
            m.preemptions.labels(*labels).inc(e.preempted)
        if e.tokens:
            step.generation_tokens.inc(e.tokens)
        if e.gaps:
            m.inter_token.add_to(labels, e.gaps)
        if e.drafted[0]:
            m.spec_drafts.labels(*labels).inc(e.drafted[0])
            m.spec_draft_tokens.labels(*labels).inc(e.drafted[1])
            m.spec_accepted.labels(*labels).inc(sum(e.accepted))
            for position, n in enumerate(e.accepted):
                m.spec_accepted_per_pos.labels(*labels, str(position)).inc(n)

    def _answered(self, reply: Reply) -> None:
        m, labels, res = self.m, (self.model, ENGINE), reply.result
        outputs = [_counts(o) for o in res.outputs or ()]
        if (prompted := _prompted(outputs, res)) is not None:
            prompt, cached, recomputed = prompted
            m.prompt_tokens.labels(*labels).inc(prompt)
            m.prefix_queries.labels(*labels).inc(prompt)
            m.prefix_hits.labels(*labels).inc(cached)
            self._sources(prompt, cached, recomputed)
        if res.status == "error":
            code = res.error.code if res.error is not None else None
            if code in ENGINE_ERRORS:
                m.success.labels(*labels, "error").inc(_outputs_asked(reply))
            return
        if res.status != "ok":  # expired: its deadline passed before it ran
            m.success.labels(*labels, "abort").inc(_outputs_asked(reply))
            return
        request = reply.request
        n = (request.n if request is not None else None) or 1
        for first in range(0, len(outputs), n):  # an input's n completions
            m.params_n.labels(*labels).observe(n)
            most = max(out.completion_tokens for out in outputs[first : first + n])
            m.max_generation_tokens.labels(*labels).observe(most)
        phases = _phases(res)
        for out in outputs:
            m.success.labels(*labels, ABORTED.get(out.finish_reason, out.finish_reason)).inc()
            m.request_prompt_tokens.labels(*labels).observe(out.prompt_tokens)
            m.request_generation_tokens.labels(*labels).observe(out.completion_tokens)
            computed = out.prompt_tokens - max(out.cached_tokens, 0)
            m.prefill_kv_computed.labels(*labels).observe(computed)
            if request is not None and request.max_new_tokens is not None:
                m.params_max_tokens.labels(*labels).observe(request.max_new_tokens)
            self._timed(out, phases)

    def _sources(self, prompt: int, cached: int, recomputed: int) -> None:
        """A request's prompt tokens by source, as vLLM's ``PromptTokenStats``: computed
        here, or cached (a fully cached prompt's last token, recomputed, counts in both)."""
        m, labels = self.m, (self.model, ENGINE)
        m.prompt_by_source.labels(*labels, "local_compute").inc(prompt - cached)
        m.prompt_by_source.labels(*labels, "local_cache_hit").inc(cached + recomputed)
        m.prompt_cached.labels(*labels).inc(cached)
        if recomputed:
            m.prompt_recomputed.labels(*labels).inc(recomputed)

    def _timed(self, out: _Output, phases: dict[str, float] | None) -> None:
        """An output's latencies: its request's (they run, and are answered, together)."""
        if phases is None:
            return
        labels = (self.model, ENGINE)
        self.m.ttft.labels(*labels).observe(phases["ttft"])
        for name, family in self.m.phases.items():
            family.labels(*labels).observe(phases[name])
        tokens = out.completion_tokens
        per_token = phases["decode"] / (tokens - 1) if tokens > 1 else 0.0
        self.m.time_per_output_token.labels(*labels).observe(per_token)


class _StepSeries(NamedTuple):
    """A model's labelled children that each step sets."""

    running: Any
    waiting: Any
    capacity: Any
    deferred: Any
    kv_usage: Any
    gpu_cache_usage: Any
    iteration_tokens: Any
    generation_tokens: Any


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
