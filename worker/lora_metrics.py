"""Per LoRA adapter metrics of the generating models of a worker, read off their runners
at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


def adapter_requests(loop: Any) -> dict[str, tuple[int, int]] | None:
    """Per adapter a new request may name, its requests (running, waiting) here: read and
    not admitted yet, preempted, or waiting for a constraint; None for a runner without
    adapters' bookkeeping."""
    counts = getattr(loop.runner, "lora_requests", None)
    if counts is None:
        return None
    waiting_here = getattr(getattr(loop, "scheduler", None), "adapters_waiting", None)
    by_adapter: dict[str, tuple[int, int]] = counts(
        waiting_here() if waiting_here is not None else ()
    )
    return by_adapter


class LoraCollector(Collector):  # type: ignore[misc]
    """Per LoRA adapter of each generating model of this worker, its requests running and
    waiting here (vLLM's ``vllm:lora_requests_info``, one series per adapter: as many as
    ``max_loras`` at most) and the memory its weights take, and the adapters loaded; read
    off the runners at each scrape."""

    def __init__(self, loops: Callable[[], Sequence[Any]]) -> None:
        self._loops = loops

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running = GaugeMetricFamily(
            "batchfleet_lora_requests_running",
            "Generation: requests running under each LoRA adapter.", labels=["model", "adapter"],
        )  # fmt: skip
        waiting = GaugeMetricFamily(
            "batchfleet_lora_requests_waiting",
            "Generation: requests under each LoRA adapter waiting here: read and not admitted "
            "yet, preempted, or waiting for a constraint.", labels=["model", "adapter"],
        )  # fmt: skip
        loaded = GaugeMetricFamily(
            "batchfleet_lora_adapters_loaded",
            "Generation: LoRA adapters a request may name.", labels=["model"],
        )  # fmt: skip
        held = GaugeMetricFamily(
            "batchfleet_lora_adapter_bytes",
            "Generation: memory each LoRA adapter's weights take on the device (one that is "
            "unloaded until its last request ends).", labels=["model", "adapter"],
        )  # fmt: skip
        for lp in self._loops():
            sizes = getattr(lp.runner, "lora_bytes", None)
            for name, size in sorted((sizes() if sizes is not None else {}).items()):
                held.add_metric([lp.model, name], size)
            by_adapter = adapter_requests(lp)
            if by_adapter is None:
                continue
            loaded.add_metric([lp.model], len(by_adapter))
            for name, (run, wait) in sorted(by_adapter.items()):
                running.add_metric([lp.model, name], run)
                waiting.add_metric([lp.model, name], wait)
        yield running
        yield waiting
        yield loaded
        yield held
