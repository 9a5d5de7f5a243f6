"""vLLM's info gauges (``vllm:lora_requests_info``, ``vllm:cache_config_info``), read off a
worker's generating runners at each scrape rather than fed by loop events."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .lora_metrics import adapter_requests
from .vllm_metrics import ENGINE


class VllmInfoCollector(Collector):  # type: ignore[misc]
    """``vllm:lora_requests_info`` and ``vllm:cache_config_info``, read off the generating
    runners at each scrape (a ``model_name`` label added: a worker may serve several)."""

    def __init__(self, loops: Callable[[], Sequence[Any]]) -> None:
        self._loops = loops

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "model_name"],
        )  # fmt: skip
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks",
                    "engine", "model_name"],
        )  # fmt: skip
        now = time.time()
        for lp in self._loops():
            runner = lp.runner
            page = getattr(runner, "page_size", None)
            kv_tokens = getattr(runner, "kv_cache_tokens", None)
            if isinstance(page, int) and isinstance(kv_tokens, int) and page > 0:
                prefix = bool(getattr(runner, "prefix_cache_tokens", 0))
                dtype = str(getattr(runner, "dtype", "auto")).removeprefix("torch.")
                blocks = -(-kv_tokens // page)
                cache.add_metric([str(page), dtype, str(prefix), str(blocks), ENGINE, lp.model], 1)
            by_adapter = adapter_requests(lp)
            if not by_adapter:
                continue
            running = ",".join(n for n, (run, _) in sorted(by_adapter.items()) if run)
            waiting = ",".join(n for n, (_, wait) in sorted(by_adapter.items()) if wait)
            max_lora = str(getattr(runner, "max_loras", len(by_adapter)))
            lora.add_metric([max_lora, waiting, running, lp.model], now)
        yield lora
        yield cache
