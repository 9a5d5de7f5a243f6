"""Endpoints: where deliveries go (``scheme://host:port``), how many may be in flight to each
across the whole fleet, and which URLs are disabled.

The cap keeps one slow or hanging receiver from holding every delivery thread: an attempt
first takes one of its endpoint's slots (a lease in Redis, so the cap holds across webhooks
workers, and a crashed worker's lease ends by itself); a delivery that finds none free waits
in the scheduled set instead of blocking a thread. An endpoint whose last attempt timed out
is "slow" and gets fewer slots until it answers in time again; and all slow endpoints
together may use only some of a worker's threads (a narrow lane), so that many slow
receivers at once still leave threads for the rest.
"""

from __future__ import annotations

import importlib.resources
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from ..connection import SyncClient
from ..schemas.keys import WebhookKeys

KEYS = WebhookKeys()
LEASE_MARGIN_S = 5.0
"""A slot's lease outlasts the attempt timeout by this much (Redis round trips, scheduling)."""
SLOW_TTL_S = 600
"""An endpoint stays slow this long after its last timeout unless it answers in time first."""

_ACQUIRE = (
    importlib.resources.files(__package__).joinpath("lua").joinpath("acquire_slot.lua").read_text()
)


def endpoint_of(url: str) -> str:
    """``scheme://host:port`` of a URL, lower-case, with the default port spelled out."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")
    try:
        port = parts.port
    except ValueError:
        port = None
    port = port or (443 if scheme == "https" else 80)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


class Slots:
    """Per-endpoint concurrency leases, and this process's lane for slow endpoints (see the
    module docstring)."""

    def __init__(
        self, client: SyncClient, cap: int, slow_cap: int, lease_s: float, slow_lane: int
    ) -> None:
        self.client = client
        self.cap = cap
        self.slow_cap = slow_cap
        self.lease_ms = int((lease_s + LEASE_MARGIN_S) * 1000)
        self._acquire = client.register_script(_ACQUIRE)
        self._slow_lane = threading.BoundedSemaphore(slow_lane)
        self._in_slow_lane: set[str] = set()
        self._lock = threading.Lock()

    def acquire(self, endpoint: str, now_ms: int) -> str | None:
        """A lease token when one of ``endpoint``'s slots was free (and, for a slow endpoint,
        a place in this process's slow lane), else None."""
        token = uuid.uuid4().hex
        keys = [KEYS.inflight(endpoint), KEYS.slow(endpoint)]
        taken = self._acquire(
            keys=keys, args=[now_ms, token, self.lease_ms, self.cap, self.slow_cap]
        )
        if taken == 0:
            return None
        if taken == 2:
            if not self._slow_lane.acquire(blocking=False):
                self.client.zrem(KEYS.inflight(endpoint), token)
                return None
            with self._lock:
                self._in_slow_lane.add(token)
        return token

    def release(
        self, endpoint: str, token: str, how: Literal["answered", "timeout", "error"]
    ) -> None:
        """Give the slot back. A timeout marks the endpoint slow, an answer clears the mark."""
        with self._lock:
            if token in self._in_slow_lane:
                self._in_slow_lane.discard(token)
                self._slow_lane.release()
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(KEYS.inflight(endpoint), token)
        if how == "answered":
            pipe.delete(KEYS.slow(endpoint))
        elif how == "timeout":
            pipe.set(KEYS.slow(endpoint), 1, ex=SLOW_TTL_S)
        pipe.execute()


@dataclass(frozen=True, slots=True)
class DisabledEndpoint:
    """A URL that answered ``410 Gone``: no delivery is attempted to it until re-enabled."""

    url: str
    at_ms: int
    webhook_id: str
    reason: str

    def summary(self) -> dict[str, Any]:
        return {"url": self.url, "at_ms": self.at_ms, "webhook_id": self.webhook_id,
                "reason": self.reason}  # fmt: skip


def is_disabled(client: SyncClient, url: str) -> bool:
    return bool(client.hexists(KEYS.disabled, url))


def disable(client: SyncClient, url: str, at_ms: int, webhook_id: str, reason: str) -> None:
    record = {"at_ms": at_ms, "webhook_id": webhook_id, "reason": reason}
    client.hset(KEYS.disabled, url, json.dumps(record))


def list_disabled(client: SyncClient) -> list[DisabledEndpoint]:
    """Every disabled URL, oldest first."""
    found = []
    for url, raw in client.hgetall(KEYS.disabled).items():
        record = json.loads(raw)
        found.append(
            DisabledEndpoint(
                url.decode() if isinstance(url, bytes) else url,
                int(record.get("at_ms", 0)),
                str(record.get("webhook_id", "")),
                str(record.get("reason", "")),
            )
        )
    return sorted(found, key=lambda e: (e.at_ms, e.url))


def enable(client: SyncClient, urls: list[str] | None = None) -> list[str]:
    """Re-enable these URLs (all disabled ones when None); returns those that were disabled.
    Deliveries that gave up meanwhile are not retried: ``redeliver`` them."""
    targets = [e.url for e in list_disabled(client)] if urls is None else urls
    if not targets:
        return []
    pipe = client.pipeline(transaction=False)
    for url in targets:
        pipe.hdel(KEYS.disabled, url)
    return [url for url, removed in zip(targets, pipe.execute(), strict=True) if removed]
