"""The gateway's Prometheus ``/metrics``: what its clients saw (requests by route and
status, latency, time to the first streamed event, tokens), what Flower and the workers'
``/metrics`` cannot show. Its own registry, so several gateways in one process (tests) do
not collide; the process collector adds its CPU and memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
"""Seconds: a pooling call (ms) up to a long generation (minutes)."""
FIRST_EVENT_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
CLIENT_LEFT: Final = 499
"""The status recorded for a request whose client closed the connection first (nginx's)."""


class GatewayMetrics:
    """The gateway's metrics; each handler reports its request once, when it ends."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.requests = Counter(
            "batchfleet_gateway_requests", "HTTP requests answered, by route, method and "
            "status (499: the client left first)", ["route", "method", "status"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "batchfleet_gateway_requests_in_flight", "HTTP requests being answered",
            ["route"], registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "batchfleet_gateway_request_duration_seconds", "Request received → answer ended "
            "(a stream's last event)", ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.first_event = Histogram(
            "batchfleet_gateway_time_to_first_event_seconds", "Streams: request received "
            "→ its first event written (time to first token, as clients see it)",
            ["route"], buckets=FIRST_EVENT_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "batchfleet_gateway_prompt_tokens", "Input tokens of the requests answered, "
            "by model (encoders' too)", ["model"], registry=r,
        )  # fmt: skip
        self.completion_tokens = Counter(
            "batchfleet_gateway_completion_tokens", "Tokens generated for the requests "
            "answered, by model", ["model"], registry=r,
        )  # fmt: skip
        self.restarts = Counter(
            "batchfleet_gateway_stream_restarts", "Streams that began again: a worker "
            "restarted the request, or the gateway read its token stream from the start "
            "(a reply-channel message may have been lost)", registry=r,
        )  # fmt: skip

    def watch(self, fleet_requests: Callable[[], float], subscribed: Callable[[], float]) -> None:
        """Gauges read when scraped: fleet requests in flight, reply subscription live."""
        Gauge("batchfleet_gateway_fleet_requests_in_flight", "Fleet requests submitted "
              "whose client is still being answered",
              registry=self.registry).set_function(fleet_requests)  # fmt: skip
        Gauge("batchfleet_gateway_reply_subscription_live", "1 while subscribed to its "
              "reply channel (else results and deltas arrive only by polling)",
              registry=self.registry).set_function(subscribed)  # fmt: skip

    def started(self, route: str) -> None:
        self.in_flight.labels(route).inc()

    def ended(self, route: str, method: str, status: int, seconds: float) -> None:
        self.in_flight.labels(route).dec()
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route).observe(seconds)

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        if prompt:
            self.prompt_tokens.labels(model).inc(prompt)
        if completion:
            self.completion_tokens.labels(model).inc(completion)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)  # type: ignore[no-any-return]
