"""vLLM's ``system_fingerprint`` of whole chat and completion answers (``--fingerprint-mode``,
vLLM's ``entrypoints/openai/fingerprint.py``), for a fleet:

- ``full`` (vLLM's default): ``batchfleet-<version>[-dp<N>]-<hash8>``: the version of the
  model's workers, ``dp<N>`` where ``N`` > 1 of them are live (the fleet's data
  parallelism: vLLM's ``dp``; a worker has no tensor, pipeline or expert parallelism),
  and the first 8 hex digits of their serving hash (``ModelInfo.config_hash``: runner,
  weights, device, dtype, options; vLLM's ``compute_hash``);
- ``hash``: ``batchfleet-<version>-<hash8>``: the parallelism left out, so scaling the fleet
  keeps it;
- ``custom``: ``--fingerprint-value``; ``none``: null.

Where the model's workers publish no serving hash (workers older than it) it is null: the
gateway cannot tell their configuration. The model's info and live workers are read again
after ``MODELS_CACHE_S`` at most, as the gateway's other reads of the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import redis

from ...connection import AsyncClient
from ...schemas.model_info import ModelInfo
from .fleet_control import live_workers
from .frontend import Frontend

logger = logging.getLogger(__name__)


def fingerprint(frontend: Frontend, info: ModelInfo | None, replicas: int) -> str | None:
    """The ``system_fingerprint`` of ``frontend``'s mode, for a model of ``info`` served by
    ``replicas`` live workers."""
    mode = frontend.fingerprint_mode
    if mode == "none":
        return None
    if mode == "custom":
        return frontend.system_fingerprint
    if info is None or info.config_hash is None:
        return None
    parts = [f"batchfleet-{info.version or 'unknown'}"]
    if mode == "full" and replicas > 1:
        parts.append(f"dp{replicas}")
    return "-".join([*parts, info.config_hash[:8]])


class Fingerprints:
    """Each model's ``system_fingerprint``, its live workers counted again after
    ``cache_s`` (only ``full`` counts them)."""

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
        self._replicas: dict[str, tuple[float, int]] = {}

    async def of(self, model: str) -> str | None:
        """``model``'s ``system_fingerprint`` (one read of its info and heartbeats at most
        every ``cache_s``)."""
        if self.frontend.fingerprint_mode in ("none", "custom"):
            return fingerprint(self.frontend, None, 0)
        info = await self.model_info(model)
        replicas = 0
        if self.frontend.fingerprint_mode == "full":
            replicas = await self._live(model)
        return fingerprint(self.frontend, info, replicas)

    async def _live(self, model: str) -> int:
        """How many of ``model``'s workers are live; where Redis fails, the last count (an
        answer is not failed for its fingerprint)."""
        at, count = self._replicas.get(model, (-self.cache_s, 0))
        if time.monotonic() - at >= self.cache_s:
            try:
                count = len(await live_workers(self.client, [model]))
            except redis.RedisError as exc:
                logger.warning("live workers of %s unread (%s): fingerprint as before", model, exc)
            self._replicas[model] = (time.monotonic(), count)
        return count
