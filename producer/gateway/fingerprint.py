"""vLLM's ``system_fingerprint`` of whole chat and completion answers (``--fingerprint-mode``,
vLLM's ``entrypoints/openai/fingerprint.py``), for a fleet:

- ``full`` (vLLM's default): ``batchfleet-<version>[-dp<N>]-<hash8>``: the version of the
  model's workers, ``dp<N>`` where the gateway's ``--data-parallel-size`` N is > 1 (the
  replicas the fleet is deployed with; a worker has no tensor, pipeline or expert
  parallelism), and the first 8 hex digits of their serving hash (``config_hash``:
  runner, weights, device, dtype, options; vLLM's ``compute_hash``). vLLM computes its
  fingerprint once, at start, from its configured parallelism, so it never changes as
  engines come and go; nor does this one as workers start and stop;
- ``hash``: ``batchfleet-<version>-<hash8>``: the parallelism left out;
- ``custom``: ``--fingerprint-value``; ``none``: null.

vLLM serves one engine configuration; a fleet's workers of one model may run different
fleet-file entries. The version and hash are those most of its live workers publish
(``bf:{model}:serving``; a tie: the smallest hash), so the fingerprint changes only when
that majority does; :meth:`Fingerprints.configs` names them all (``/v1/models`` warns of a
mixed fleet). Where no live worker publishes its own (workers older than it), the model's
info is read (the last worker started's). Where neither has a hash it is null: the gateway
cannot tell their configuration. Both are read again after ``MODELS_CACHE_S`` at most.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import redis

from ...connection import AsyncClient
from ...schemas.model_info import ModelInfo, WorkerServing
from .fleet_control import live_serving
from .frontend import Frontend

logger = logging.getLogger(__name__)

Served = ModelInfo | WorkerServing
"""What a fingerprint reads: a version and a serving hash."""


def fingerprint(frontend: Frontend, served: Served | None) -> str | None:
    """The ``system_fingerprint`` of ``frontend``'s mode, for a model served as ``served``
    says (its version and serving hash)."""
    mode = frontend.fingerprint_mode
    if mode == "none":
        return None
    if mode == "custom":
        return frontend.system_fingerprint
    if served is None or served.config_hash is None:
        return None
    parts = [f"batchfleet-{served.version or 'unknown'}"]
    if mode == "full" and frontend.data_parallel_size > 1:
        parts.append(f"dp{frontend.data_parallel_size}")
    return "-".join([*parts, served.config_hash[:8]])


def configs(cards: dict[str, WorkerServing | None]) -> Counter[str]:
    """How many of the live workers ``cards`` describe serve with each serving hash."""
    return Counter(c.config_hash for c in cards.values() if c is not None and c.config_hash)


def majority(cards: dict[str, WorkerServing | None]) -> WorkerServing | None:
    """What most of the live workers ``cards`` describe serve with (a tie: the smallest
    hash); None where none published a hash."""
    counts = configs(cards)
    if not counts:
        return None
    top = min(counts, key=lambda h: (-counts[h], h))
    return next(c for c in cards.values() if c is not None and c.config_hash == top)


class Fingerprints:
    """Each model's ``system_fingerprint``, its live workers' serving entries read again
    after ``cache_s``."""

    def __init__(
        self,
        frontend: Frontend,
        client: AsyncClient,
        model_info: Callable[[str], Awaitable[ModelInfo | None]],
        cache_s: float,
    ) -> None:
        self.frontend = frontend
        self.client = client
        self.model_info = model_info
        self.cache_s = cache_s
        self._cards: dict[str, tuple[float, dict[str, WorkerServing | None]]] = {}

    async def of(self, model: str) -> str | None:
        """``model``'s ``system_fingerprint`` (one read of its workers' serving entries at
        most every ``cache_s``; its info where none publishes one)."""
        if self.frontend.fingerprint_mode in ("none", "custom"):
            return fingerprint(self.frontend, None)
        served = majority(await self.live(model))
        return fingerprint(self.frontend, served or await self.model_info(model))

    async def configs(self, model: str) -> Counter[str]:
        """The serving hashes ``model``'s live workers publish, each with how many: more
        than one is a mixed fleet (answers may differ by the worker that computed them)."""
        return configs(await self.live(model))

    async def live(self, model: str) -> dict[str, WorkerServing | None]:
        """``model``'s live workers and what each serves with; where Redis fails, the last
        read (an answer is not failed for its fingerprint)."""
        at, cards = self._cards.get(model, (-self.cache_s, {}))
        if time.monotonic() - at >= self.cache_s:
            try:
                cards = await live_serving(self.client, model)
            except redis.RedisError as exc:
                logger.warning("live workers of %s unread (%s): fingerprint as before", model, exc)
            self._cards[model] = (time.monotonic(), cards)
        return cards
