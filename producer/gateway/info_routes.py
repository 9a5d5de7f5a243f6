"""The routes that describe the gateway and its fleet: ``/v1/models``, ``/health`` and
``/livez``, ``/metrics``; and the 404 of a path no route serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ...schemas.errors import BatchfleetError
from ...schemas.model_info import ModelInfo
from .errors import ApiError, of_exception
from .handler import Handler
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .state import Gateway


class Metrics(Handler):
    """``/metrics``: Prometheus' text format (no key, as vLLM's)."""

    def get(self) -> None:
        self.set_header("Content-Type", METRICS_CONTENT_TYPE)
        self.finish(self.gateway.metrics.exposition())


class Models(Handler):
    async def get(self, name: str | None = None) -> None:
        try:
            names = await self.gateway.models()
            adapters = await self.gateway.adapters()
        except BatchfleetError as exc:
            return self.fail(of_exception(exc))
        shown = [*names, *(a for a in adapters if a not in names)]
        if name is not None:
            if name not in shown:
                return self.fail(ApiError(404, f"The model {name!r} does not exist",
                                          code="model_not_found"))  # fmt: skip
            shown = [name]
        bases = [adapters.get(n, n) if n not in names else n for n in shown]
        infos = await asyncio.gather(*(self.gateway.model_info(b) for b in bases))
        mixes = await asyncio.gather(*(self.gateway.fingerprints.configs(b) for b in bases))
        cards = [model_card(n, i, None if n == b else b, m)
                 for n, b, i, m in zip(shown, bases, infos, mixes, strict=True)]  # fmt: skip
        self.send_json({"object": "list", "data": cards} if name is None else cards[0])


def model_card(
    name: str,
    info: ModelInfo | None,
    parent: str | None = None,
    configs: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """vLLM's model card: ``max_model_len`` (and ``created``) where the model's workers
    published them, left out where they did not (workers older than ``bf:{model}:info``);
    a LoRA adapter's names its base model ``parent`` (its ``info``: the base's). Where its
    live workers serve it with more than one configuration (``configs``: serving hash →
    workers), a ``warning`` says so and ``serving_hashes`` lists them (a field of ours)."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0,
                            "owned_by": "batchfleet", "root": name, "parent": parent}  # fmt: skip
    if info is not None:
        card["created"] = info.created
        if info.max_model_len is not None:
            card["max_model_len"] = info.max_model_len
    if configs is not None and len(configs) > 1:
        listed = ", ".join(f"{h[:8]} ({n})" for h, n in sorted(configs.items()))
        card["warning"] = (f"mixed fleet: its live workers serve it with {len(configs)} "
                           f"configurations ({listed}); answers may differ by the worker "
                           "that computed them, and system_fingerprint names the most common")  # fmt: skip
        card["serving_hashes"] = dict(sorted(configs.items()))
    return card


class Health(Handler):
    """``/health``: 200 when Redis (every master of a cluster) answers a PING within
    :data:`~.readiness.READY_TIMEOUT_S` and the reply channel is subscribed (ready), else
    503, also once it is stopping; ``/livez``: 200 while the process serves HTTP at
    all (alive)."""

    def initialize(self, gateway: Gateway, deep: bool = True) -> None:
        super().initialize(gateway)
        self.deep = deep

    async def get(self) -> None:
        if self.deep and self.gateway.stopping:
            return self.fail(ApiError(503, "the gateway is shutting down", code="unavailable"))
        if self.deep:
            if (why := await self.gateway.readiness.unready()) is not None:
                return self.fail(ApiError(503, why, code="unavailable"))
            if not self.gateway.replies.live:
                return self.fail(ApiError(503, "not subscribed to the reply channel yet",
                                          code="unavailable"))  # fmt: skip
        self.set_status(200)
        self.finish()


class NotFound(Handler):
    def prepare(self) -> None:
        super().prepare()
        if not self._finished:
            self.fail(ApiError(404, f"no route {self.request.method} {self.request.path}",
                               code="not_found"))  # fmt: skip
