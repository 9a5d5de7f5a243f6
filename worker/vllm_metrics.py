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

from .metric_children import Hist, Level, Series
from .observers import Answered, Generated, LoopEvent
from .token_gaps import TokenGaps
from .vllm_results import PHASES, Gathered

ENGINE = "0"
LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``FINISH_REASON_STRINGS``: each ``vllm:request_success_total`` series exists
from the start."""
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
    whose fleet entry runs ``text-generation``, or any that reports a step. A batch of
    results updates each series once (:class:`~.vllm_results.Gathered`)."""

    def __init__(self, metrics: VllmMetrics, model: str, generating: bool) -> None:
        self.m = metrics
        self.model = model
        self.generating = False
        self.series = Series()
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
            gathered = Gathered()
            for reply in event.replies:
                gathered.add(reply)
            self._answered(gathered)

    def _generated(self, e: Generated) -> None:
        m, labels = self.m, (e.model, ENGINE)
        count = self.series.count
        step = self.series.group(labels, lambda: _StepSeries.of(self.series, m, labels))
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
            count(m.preemptions, *labels).inc(e.preempted)
        if e.tokens:
            step.generation_tokens.inc(e.tokens)
        if e.gaps:
            m.inter_token.add_to(labels, e.gaps)
        if e.drafted[0]:
            count(m.spec_drafts, *labels).inc(e.drafted[0])
            count(m.spec_draft_tokens, *labels).inc(e.drafted[1])
            count(m.spec_accepted, *labels).inc(sum(e.accepted))
            for position, n in enumerate(e.accepted):
                count(m.spec_accepted_per_pos, *labels, str(position)).inc(n)

    def _answered(self, got: Gathered) -> None:
        """A batch of results' counts and observations, each series updated once."""
        m, labels = self.m, (self.model, ENGINE)
        count, hist = self.series.count, self.series.hist
        if got.prompted:
            count(m.prompt_tokens, *labels).inc(got.prompt)
            count(m.prefix_queries, *labels).inc(got.prompt)
            count(m.prefix_hits, *labels).inc(got.cached)
            self._sources(got)
        for reason, n in got.success.items():
            count(m.success, *labels, reason).inc(n)
        for family, values in (
            (m.params_n, got.params_n), (m.max_generation_tokens, got.most_generated),
            (m.request_prompt_tokens, got.prompt_tokens),
            (m.request_generation_tokens, got.generation_tokens),
            (m.prefill_kv_computed, got.prefill_computed),
            (m.params_max_tokens, got.max_tokens), (m.ttft, got.ttft),
            *((m.phases[name], got.phases[name]) for name in PHASES),
            (m.time_per_output_token, got.per_output_token),
        ):  # fmt: skip
            if values:
                hist(family, *labels).observe_all(values)

    def _sources(self, got: Gathered) -> None:
        """Prompt tokens by source, as vLLM's ``PromptTokenStats``: computed here, or
        cached (a fully cached prompt's last token, recomputed, counts in both)."""
        m, labels, count = self.m, (self.model, ENGINE), self.series.count
        count(m.prompt_by_source, *labels, "local_compute").inc(got.prompt - got.cached)
        count(m.prompt_by_source, *labels, "local_cache_hit").inc(got.cached + got.recomputed)
        count(m.prompt_cached, *labels).inc(got.cached)
        if got.recomputing:
            count(m.prompt_recomputed, *labels).inc(got.recomputed)


class _StepSeries(NamedTuple):
    """A model's series that each step sets."""

    running: Level
    waiting: Level
    capacity: Level
    deferred: Level
    kv_usage: Level
    gpu_cache_usage: Level
    iteration_tokens: Hist
    generation_tokens: Any

    @classmethod
    def of(cls, series: Series, m: VllmMetrics, labels: tuple[str, str]) -> _StepSeries:
        level = series.level
        return cls(level(m.running, *labels), level(m.waiting, *labels),
                   level(m.waiting_by_reason, *labels, "capacity"),
                   level(m.waiting_by_reason, *labels, "deferred"),
                   level(m.kv_usage, *labels), level(m.gpu_cache_usage, *labels),
                   series.hist(m.iteration_tokens, *labels),
                   series.count(m.generation_tokens, *labels))  # fmt: skip
