"""The Prometheus metric families a worker process reports: their names, help texts,
labels and buckets, in one registry (:class:`Metrics`), fed by the loop's
:class:`~.metrics.PrometheusObserver`. Kept apart from the observer and the ``/metrics``
server so that the list of what is reported reads in one place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..schemas.errors import ErrorCode
from .token_gaps import TokenGaps

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = tuple(2**i for i in range(4, 18))
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
"""A constraint's compile: one tool's schema (about 1 ms) to a large schema (tens of ms) and
past (a big vocabulary)."""
STATUSES = ("ok", "error", "expired")
"""The values of a result's ``status``."""


class Metrics:
    """The metric families of one worker, in their own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def hist(name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets)

        def counter(name: str, doc: str, labels: Sequence[str]) -> Any:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, ["model"], registry=registry)

        self.batch_rows = hist(
            "batchfleet_batch_rows", "Rows (inputs) per micro-batch.", ["model"], ROW_BUCKETS
        )
        self.padded_tokens = hist(
            "batchfleet_batch_padded_tokens",
            "Padded tokens per micro-batch (rows x longest row).",
            ["model"],
            TOKEN_BUCKETS,
        )
        self.padding_waste = hist(
            "batchfleet_batch_padding_waste_ratio",
            "Share of a batch's padded tokens that are padding.",
            ["model"],
            RATIO_BUCKETS,
        )
        self.inference = hist(
            "batchfleet_inference_seconds",
            "Device time of a micro-batch.",
            ["model"],
            LATENCY_BUCKETS,
        )
        self.queue_wait = hist(
            "batchfleet_queue_wait_seconds",
            "Enqueue to read by a worker.",
            ["model", "lane"],
            LATENCY_BUCKETS,
        )
        self.batch_wait = hist(
            "batchfleet_batch_wait_seconds",
            "Read to batch dispatched.",
            ["model", "lane"],
            LATENCY_BUCKETS,
        )
        self.latency = hist(
            "batchfleet_request_latency_seconds",
            "Enqueue to result stored (end to end).",
            ["model", "lane"],
            LATENCY_BUCKETS,
        )
        self.batches = counter(
            "batchfleet_batches", "Micro-batches dispatched, by reason.", ["model", "reason"]
        )
        self.rows = counter("batchfleet_batch_rows_processed", "Rows computed.", ["model"])
        self.results = counter(
            "batchfleet_results",
            "Results stored, by status (ok, error, expired: expirations).",
            ["model", "lane", "status"],
        )
        self.errors = counter(
            "batchfleet_errors", "Error and expired results, by code.", ["model", "code"]
        )
        self.dead_letters = counter(
            "batchfleet_dead_letters", "Entries moved to the dead-letter stream.", ["model", "code"]
        )
        self.oom = counter(
            "batchfleet_out_of_memory", "Micro-batches that ran out of device memory.", ["model"]
        )
        # text generation
        self.first_token = hist(
            "batchfleet_time_to_first_token_seconds",
            "Generation: enqueue to its first token.",
            ["model", "lane"],
            LATENCY_BUCKETS,
        )
        self.inter_token = TokenGaps()
        registry.register(self.inter_token)
        self.generated_tokens = counter(
            "batchfleet_generated_tokens", "Generation: completion tokens of answered requests.",
            ["model"],
        )  # fmt: skip
        self.step_tokens = counter(
            "batchfleet_step_generated_tokens",
            "Generation: tokens generated, counted at each step (rate(): tokens/s as they are "
            "produced).",
            ["model"],
        )
        self.step_prefill = counter(
            "batchfleet_step_prefill_tokens",
            "Generation: prompt tokens prefilled (cached ones left out), counted at the step "
            "that ends a sequence's prefill (rate(): prefill tokens/s).",
            ["model"],
        )
        self.prompt_tokens = counter(
            "batchfleet_prompt_tokens", "Generation: prompt tokens of answered requests.", ["model"]
        )
        self.cached_tokens = counter(
            "batchfleet_prompt_cached_tokens",
            "Generation: prompt tokens of answered requests not prefilled (prefix cache hits).",
            ["model"],
        )
        self.spec_drafts = counter(
            "batchfleet_spec_decode_num_drafts",
            "Speculative decoding: decode rows that proposed drafts (vLLM's num_drafts).",
            ["model"],
        )
        self.spec_draft_tokens = counter(
            "batchfleet_spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens proposed.", ["model"],
        )  # fmt: skip
        self.spec_accepted = counter(
            "batchfleet_spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (accepted / draft tokens: the "
            "acceptance rate; 1 + accepted / drafts: the mean tokens a row emits a step).",
            ["model"],
        )
        self.spec_accepted_per_pos = counter(
            "batchfleet_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position (0: the first).",
            ["model", "position"],
        )
        self.spec_skipped = counter(
            "batchfleet_spec_decode_num_skipped_rows",
            "Speculative decoding: decode rows that proposed no drafts because the step's "
            "batch size turned speculation off (disable_by_batch_size, or a k = 0 range of "
            "num_speculative_tokens_per_batch_size).",
            ["model"],
        )
        self.preemptions = counter(
            "batchfleet_preemptions", "Generation: running sequences preempted (resumed later; each of an n > 1 request counts).",
            ["model"],
        )  # fmt: skip
        self.running = gauge(
            "batchfleet_generation_running_sequences", "Generation: sequences in the KV cache."
        )
        self.waiting = gauge(
            "batchfleet_generation_waiting_requests",
            "Generation: requests read and not running (new or preempted).",
        )
        self.kv_usage = gauge(
            "batchfleet_kv_cache_usage_ratio",
            "Generation: share of the KV cache the running sequences hold.",
        )
        self.compiling = gauge(
            "batchfleet_constraints_compiling",
            "Generation: admitted requests waiting for their structured-output constraints "
            "to compile.",
        )
        self.compile = hist(
            "batchfleet_constraint_compile_seconds",
            "Generation: how long a new structured-output constraint took to compile.",
            ["model"],
            COMPILE_BUCKETS,
        )

    def init_model(self, model: str, lanes: int) -> None:
        """Create a model's counter series at 0, so that they exist before their first event:
        Grafana panels are not empty and ``rate()`` and alerts see a series from the start."""
        for lane in range(lanes):
            for status in STATUSES:
                self.results.labels(model, str(lane), status)
        for code in ErrorCode:
            self.errors.labels(model, code.value)
            self.dead_letters.labels(model, code.value)
        self.oom.labels(model)
        self.rows.labels(model)
        self.preemptions.labels(model)
        self.compile.labels(model)
        self.generated_tokens.labels(model)
        self.step_tokens.labels(model)
        self.step_prefill.labels(model)
        self.prompt_tokens.labels(model)
        self.cached_tokens.labels(model)
