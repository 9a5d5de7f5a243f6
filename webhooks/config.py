"""The ``[webhooks]`` section of the fleet file: secrets, SSRF policy, timeouts, retries.

Example::

    [webhooks]
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"   # the fleet's default signing secret
    allow = ["hooks.internal.example", "10.20.0.0/16"]  # internal targets an operator permits
    [webhooks.secrets]                                  # per endpoint: a request's secret_id
    acme = "whsec_..."

Environment: ``BATCHFLEET_WEBHOOKS__SECRET=whsec_...`` (secrets belong in the environment or
a secret store rather than in a checked-in file).
"""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

SECRET_PREFIX = "whsec_"


def _check_secret(value: SecretStr) -> SecretStr:
    import base64
    import binascii

    raw = value.get_secret_value()
    if not raw.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret must be in the '{SECRET_PREFIX}<base64>' format")
    try:
        key = base64.b64decode(raw.removeprefix(SECRET_PREFIX), validate=True)
    except binascii.Error:
        raise ValueError("a webhook secret must be whsec_ followed by base64") from None
    if not 24 <= len(key) <= 64:
        raise ValueError("a webhook secret must hold 24 to 64 random bytes")
    return value


class WebhooksConfig(BaseModel):
    """How results are POSTed to the webhooks requests carry."""

    model_config = ConfigDict(extra="forbid")

    secret: SecretStr | None = None
    """Default signing secret (``whsec_<base64>``) for requests that name no ``secret_id``."""
    secrets: dict[str, SecretStr] = Field(default_factory=dict)
    """Per-endpoint secrets by id: a request chooses one with ``webhook.secret_id``."""

    allow_http: bool = False
    """Permit plain ``http://`` URLs (only https by default)."""
    allow: list[str] = Field(default_factory=list)
    """Hosts and CIDRs exempt from the private-address filter (internal targets)."""

    connect_timeout_s: float = Field(5.0, gt=0, le=60)
    read_timeout_s: float = Field(10.0, gt=0, le=300)
    """Longest wait for each read of the response (so also for the status line)."""
    attempt_timeout_s: float = Field(15.0, gt=0, le=600)
    """Longest time one attempt may take in all: connect, send, and the whole response. An
    endpoint that drips its answer a byte at a time is cut off here (and retried)."""
    redeliver_after_s: float | None = Field(None, gt=0, le=3600)
    """A delivery whose webhooks worker died mid-attempt (SIGKILL, OOM, lost node) runs again
    on another webhooks worker this long after it started: the Redis broker's visibility
    timeout (kombu's default is an hour). It must outlast one attempt, or a slow attempt
    would also run twice; default ``2 * attempt_timeout_s + 30`` (60 s at the defaults)."""
    max_response_bytes: int = Field(64 * 1024, ge=0, le=16 * 1024 * 1024)
    """More of a response body than this is not read."""

    max_attempts: int = Field(10, ge=1, le=100)
    backoff_base_s: float = Field(2.0, gt=0)
    """Delay after the first failed attempt; doubles each attempt (with jitter)."""
    backoff_max_s: float = Field(6 * 3600.0, gt=0)
    """Longest delay between two attempts, Retry-After included."""
    max_countdown_s: float | None = Field(None, gt=0)
    """Ignored (kept so older fleet files load): every wait now sits in Redis,
    ``bf:webhooks:scheduled``, never as a Celery ETA held in a worker's memory."""
    failed_maxlen: int = Field(100_000, ge=1)
    """Dead-letter records kept (``bf:webhooks:failed``)."""

    concurrency: int = Field(8, ge=1, le=256)
    """Threads of a ``batchfleet webhooks worker``: deliveries in flight at once."""
    endpoint_concurrency: int = Field(4, ge=1, le=1024)
    """Deliveries in flight at once to one endpoint (scheme, host, port), fleet-wide; more
    wait in ``bf:webhooks:scheduled`` without holding a thread. Keep it under
    ``concurrency`` so one hanging endpoint cannot take every thread."""
    slow_endpoint_concurrency: int = Field(1, ge=1, le=1024)
    """The same for an endpoint whose last attempt timed out, until it answers in time.
    Slow endpoints together may also use at most half of a worker's ``concurrency``."""

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: SecretStr | None) -> SecretStr | None:
        return None if v is None else _check_secret(v)

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: dict[str, SecretStr]) -> dict[str, SecretStr]:
        return {name: _check_secret(s) for name, s in v.items()}

    @field_validator("allow")
    @classmethod
    def _allow(cls, v: list[str]) -> list[str]:
        for item in v:
            if "/" in item:
                ipaddress.ip_network(item, strict=False)  # raises ValueError on a bad CIDR
            elif (not item or any(c in item for c in " :@[]")) and not _is_ip(item):
                raise ValueError(f"allow entry {item!r} is neither a host nor a CIDR")
        return v

    @model_validator(mode="after")
    def _backoff(self) -> WebhooksConfig:
        if self.backoff_base_s > self.backoff_max_s:
            raise ValueError("backoff_base_s must not exceed backoff_max_s")
        if self.redeliver_after_s is not None and self.redeliver_after_s <= self.attempt_timeout_s:
            raise ValueError("redeliver_after_s must exceed attempt_timeout_s")
        return self

    def redelivery_s(self) -> float:
        """The broker's visibility timeout for delivery tasks (see ``redeliver_after_s``)."""
        if self.redeliver_after_s is not None:
            return self.redeliver_after_s
        return 2 * self.attempt_timeout_s + 30.0

    def broker_transport_options(self) -> dict[str, float | int]:
        """kombu's Redis transport options: redeliver after :meth:`redelivery_s`, swept for
        at least every sixth of it (kombu sweeps every 100 s by default)."""
        after = self.redelivery_s()
        return {
            "visibility_timeout": after,
            "unacked_restore_interval": max(1, int(after / 6)),
            "unacked_restore_throttle": 1,
        }

    def secret_for(self, secret_id: str | None) -> str | None:
        """The ``whsec_`` secret a delivery is signed with, or None if none is configured."""
        found = self.secret if secret_id is None else self.secrets.get(secret_id)
        return None if found is None else found.get_secret_value()


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True
