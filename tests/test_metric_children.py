"""A step's (or a batch of results') updates in one pass give the very exposition that one
update per event gives: histograms' buckets and float sums, gauges, counters, and the
series the observers create (tests for :mod:`batchfleet.worker.metric_children`)."""

from __future__ import annotations

import math

import pytest
from batchfleet.schemas.messages import Request, Result
from batchfleet.worker.metric_children import Hist, Level, Series
from batchfleet.worker.metric_families import Metrics
from batchfleet.worker.metrics import PrometheusObserver
from batchfleet.worker.observers import Answered, Observers, Reply
from batchfleet.worker.vllm_metrics import VllmMetrics, VllmObserver
from prometheus_client import CollectorRegistry, Gauge, Histogram, Summary, generate_latest

BUCKETS = (0.001, 0.01, 0.1, 0.2, 0.3, 1.0, 10.0)
VALUES = [0.1, 0.2, 0.3, 1e16, 1.0, -1e16, 0.1, 0.2, 0.3,  # the sum depends on the order
          0.001, 0.01, 10.0, 10.000001, 0.0, -3.5, 7, 1e-300,  # bounds, past them, ints
          math.inf, -math.inf, math.nan, 0.30000000000000004]  # fmt: skip


def exposition(registry: CollectorRegistry) -> str:
    """``/metrics`` text without the ``_created`` series (when each series was made)."""
    text = generate_latest(registry).decode()
    return "\n".join(line for line in text.splitlines() if "_created" not in line)


def histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("h", "A histogram.", ["model"], registry=registry, buckets=BUCKETS)


@pytest.mark.parametrize("values", [VALUES, VALUES[:3], [], [math.nan], [5] * 40])
def test_a_histogram_s_bulk_observation_is_byte_identical_to_one_at_a_time(
    values: list[float],
) -> None:
    one_registry, one = histogram()
    bulk_registry, bulk = histogram()
    each_registry, each = histogram()
    child = one.labels("m")
    for value in values:
        child.observe(value)
    Hist(bulk.labels("m")).observe_all(values)
    single = Hist(each.labels("m"))
    for value in values:
        single.observe(value)

    assert exposition(bulk_registry) == exposition(one_registry)
    assert exposition(each_registry) == exposition(one_registry)


def test_a_child_without_buckets_falls_back_to_its_own_observe() -> None:
    registry = CollectorRegistry()
    summary = Summary("s", "A summary.", ["model"], registry=registry)
    Hist(summary.labels("m")).observe_all([0.5, 1.5])
    Hist(summary.labels("m")).observe(2.0)
    assert registry.get_sample_value("s_count", {"model": "m"}) == 3
    assert registry.get_sample_value("s_sum", {"model": "m"}) == 4.0


def test_a_level_sets_its_gauge_only_when_the_value_changed() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("g", "A gauge.", ["model"], registry=registry)
    sets: list[float] = []
    child = gauge.labels("m")
    real_set = child.set
    child.set = lambda v: (sets.append(v), real_set(v))  # type: ignore[method-assign]
    level = Level(child)
    for value in (3, 3, 5, 5.0, 0, 0, math.nan, math.nan, 2.5):
        level.set(value)
    assert registry.get_sample_value("g", {"model": "m"}) == 2.5
    assert sets[:3] == [3, 5, 0] and sets[-1] == 2.5
    assert len(sets) == 6  # and NaN twice: it never equals itself


def test_series_are_looked_up_once() -> None:
    _, family = histogram()
    series = Series()
    assert series.hist(family, "m") is series.hist(family, "m")
    assert series.count(family, "m") is family.labels("m")
    made = series.group(("k",), lambda: object())
    assert series.group(("k",), lambda: object()) is made


def results() -> list[Reply]:
    """Results of every kind a batch brings: lanes, statuses, ``n``, cached prompts."""

    def out(reason: str, prompt: int, completion: int, cached: int = 0) -> dict[str, object]:
        return {"finish_reason": reason, "prompt_tokens": prompt,
                "completion_tokens": completion, "cached_tokens": cached, "text": "x"}  # fmt: skip

    def timed(total: float, first: float | None) -> dict[str, object]:
        return {"queued_ms": total / 7, "batch_wait_ms": total / 13, "inference_ms": total / 3,
                "total_ms": total, "first_token_ms": first}  # fmt: skip

    def reply(lane: int, rid: str, status: str, request: Request | None, **fields: object) -> Reply:
        result = Result.model_validate({"id": rid, "model": "tiny", "status": status, **fields})
        return Reply(lane, request, result, True)

    def req(rid: str, inputs: int = 1, n: int | None = None, most: int | None = 300) -> Request:
        return Request(id=rid, model="tiny", inputs=["hi"] * inputs, n=n, max_new_tokens=most)

    usage = {"prompt_tokens": 40, "completion_tokens": 9,
             "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
    return [
        reply(1, "e", "error", req("e"), timings=timed(123.4, None),
              error={"code": "inference_failed", "message": "m"}),
        reply(0, "a", "ok", req("a"), timings=timed(1010.1, 33.3),
              outputs=[out("stop", 40, 9, 16)], usage=usage),
        reply(1, "n", "ok", req("n", inputs=2, n=2, most=None), timings=timed(777.7, 12.5),
              outputs=[out("length", 12, 4), out("stop", 12, 7, 11), out("deadline", 9, 1),
                       out("cancelled", 9, 0, 8)],
              usage={"prompt_tokens": 21, "completion_tokens": 12}),
        reply(0, "x", "expired", req("x", inputs=3), timings=timed(5000.0, None)),
        reply(1, "c", "ok", None, timings=timed(0.3, 0.1), outputs=[{"text": ""}], usage=usage),
        reply(0, "i", "error", req("i"), timings=timed(2.0, None),
              error={"code": "invalid_input", "message": "m"}),
        reply(0, "t", "ok", req("t"), timings=timed(64.0, 8.0),
              outputs=[out("tool_calls", 17, 3)]),
    ]  # fmt: skip


def fed(batches: list[list[Reply]]) -> tuple[CollectorRegistry, str]:
    """A fresh worker registry's exposition once its observers heard these batches."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.init_model("tiny", 2)
    observers = Observers([PrometheusObserver(metrics),
                           VllmObserver(VllmMetrics(registry), "tiny", generating=True)])  # fmt: skip
    for replies in batches:
        observers.notify(Answered("tiny", replies))
    return registry, exposition(registry)


def test_a_batch_of_results_updates_the_metrics_as_one_result_at_a_time_does() -> None:
    # Given results of every kind, and the same results each in a batch of its own
    replies = results()
    registry, batched = fed([replies, replies[2:5]])
    _, one_by_one = fed([[reply] for reply in [*replies, *replies[2:5]]])

    # Then the exposition is the same, byte for byte
    assert batched == one_by_one
    get = registry.get_sample_value
    assert get("vllm:request_success_total", {"model_name": "tiny", "engine": "0",
                                              "finished_reason": "abort"}) == 2 * (3 + 2)  # fmt: skip
    # a lane's wait series exist from its first result (lane 1's first is an error)
    assert get("batchfleet_queue_wait_seconds_count", {"model": "tiny", "lane": "1"}) == 4
    lanes = [line for line in batched.splitlines()
             if line.startswith("batchfleet_queue_wait_seconds_count")]  # fmt: skip
    assert ['lane="1"' in line for line in lanes] == [True, False]
