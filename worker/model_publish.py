"""What a worker publishes of its model for producers, gateways and control commands: the
lanes' consumer groups, the lane count and limits, the model's info and tokenizer, and the
LoRA adapters loaded or unloaded while it serves."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis

from ..schemas.keys import GROUP, LORA_UNLOADED, MODELS_KEY
from ..schemas.messages import Limits
from ..schemas.model_info import ModelInfo, decode_model_info
from .redis_model import ModelRedis


class ModelPublisher(ModelRedis):
    """Writes (and reads back) a model's published state: no TTL, each worker writes it
    when it starts."""

    def ensure_groups(
        self, max_depth: int | None = None, limits: Limits | None = None,
        info: ModelInfo | None = None, tokenizer: Mapping[str, Any] | None = None,
        heartbeat_timeout_ms: int | None = None,
    ) -> None:  # fmt: skip
        """Create the group on every lane (from the stream's start, so nothing queued before
        the first worker is missed) and publish the lane count, depth limit and request
        limits for producers, and the model's info and ``tokenizer`` configuration for
        gateways (:meth:`publish_info`, :meth:`publish_tokenizer`), and the heartbeat
        timeout for control commands."""
        for stream in self.streams:
            try:
                self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self.client.set(self.keys.lanes_key, self.lanes)
        self.client.sadd(MODELS_KEY, self.keys.model)
        if limits is not None:
            self.client.set(self.keys.limits, limits.model_dump_json())
        if info is not None:
            self.publish_info(info)
        if tokenizer is not None:
            self.publish_tokenizer(tokenizer)
        if heartbeat_timeout_ms is not None:
            self.client.set(self.keys.heartbeat_timeout, heartbeat_timeout_ms)
        if max_depth:
            self.client.set(self.keys.max_depth, max_depth)
        else:
            self.client.delete(self.keys.max_depth)

    def publish_info(self, info: ModelInfo) -> None:
        """Write the model's info (no TTL, as the limits: each worker writes it when it
        starts), keeping the ``created`` of the info already there, if any."""
        raw = self.client.get(self.keys.info)
        if raw is not None:
            try:
                created = decode_model_info(raw).created
            except ValueError:  # not ours to read: replaced
                created = 0
            if 0 < created < info.created or not info.created:
                info = info.model_copy(update={"created": created})
        self.client.set(self.keys.info, info.model_dump_json())

    def publish_tokenizer(self, config: Mapping[str, Any]) -> None:
        """Write the model's tokenizer configuration (``/tokenizer_info``'s body; no TTL,
        as the info: each worker writes it when it starts)."""
        self.client.set(self.keys.tokenizer, json.dumps(config, separators=(",", ":")))

    def lora_loaded(self, name: str, path: str) -> None:
        """An adapter loaded while the model serves: workers started later load it too
        (every worker the broadcast reaches writes the same value)."""
        self.client.hset(self.keys.lora, name, path)

    def lora_unloaded(self, name: str) -> None:
        """An adapter unloaded while the model serves: workers started later do not serve
        it, not even from their fleet file (a tombstone, until it is loaded again)."""
        self.client.hset(self.keys.lora, name, LORA_UNLOADED)

    def loras(self) -> dict[str, str | None]:
        """The adapters loaded (name → directory) and unloaded (name → None) while the
        model serves."""
        raw = self.client.hgetall(self.keys.lora)
        return {_text(k): _text(v) if _text(v) != LORA_UNLOADED else None
                for k, v in raw.items()}  # fmt: skip


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
