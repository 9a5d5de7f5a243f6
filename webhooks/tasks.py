"""The delivery task: one attempt per run, on the Celery queue ``webhooks``.

Each attempt is a Celery task run, so Flower shows it (state, retries, runtime). Timeouts,
connection errors, 429 and 5xx are retried with exponential backoff and jitter (at least
``Retry-After``); 410 disables the endpoint; other 4xx and refused URLs fail at once. Short
waits are Celery countdowns; longer ones wait in the sorted set ``bf:webhooks:scheduled``
(see :mod:`.worker`), because a Celery ETA task is held unacknowledged and the Redis broker
redelivers it after its visibility timeout. A delivery that gives up becomes a dead-letter
record (:mod:`.deadletter`). The result itself stays stored and pollable throughout.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from celery import Celery, Task
from pydantic import BaseModel, ConfigDict

from ..connection import SyncClient, connect
from ..schemas.codec import decode_result, pack, result_map
from ..schemas.keys import WEBHOOK_QUEUE, ModelKeys, WebhookKeys
from ..schemas.messages import Format
from . import deadletter, endpoints, ssrf, status
from .config import WebhooksConfig
from .errors import AttemptTimeout, DeliveryFailed, NetworkError, TargetRefused
from .signing import headers as signed_headers
from .status import State, WebhookStatus

logger = logging.getLogger(__name__)

TASK_NAME = "batchfleet.webhooks.deliver"
EVENT_TYPE = "inference.result"
_NAMESPACE = uuid.UUID("0b5c0a51-7e2f-4d0c-9a55-1f1eb7c0a6d1")
USER_AGENT = "batchfleet-webhooks/1"


def webhook_id(model: str, request_id: str, finished_at_ms: int) -> str:
    """The ``webhook-id`` of a result: the same on every attempt and redelivery, and new
    for a new result even if a client reuses a request id after the old one expired."""
    return "msg_" + uuid.uuid5(_NAMESPACE, f"{model}\0{request_id}\0{finished_at_ms}").hex


class Delivery(BaseModel):
    """The task's arguments: which result goes where (small: the body is read from Redis)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    request_id: str
    url: str
    webhook_id: str
    secret_id: str | None = None
    format: Format = "json"
    first_attempt_ms: int | None = None
    """Unix ms of the first attempt (set by it)."""
    redelivery_of: str | None = None
    """Dead-letter record id this is a redelivery of: the body comes from there."""
    busy: int = 0
    """Times in a row this delivery found its endpoint's slots all in use (no attempt made)."""


Verdict = Literal["delivered", "retry", "fail", "gone", "refused", "disabled", "busy"]
FINAL_STATE: dict[Verdict, State] = {
    "fail": "failed",
    "retry": "failed",  # out of attempts
    "gone": "disabled",
    "disabled": "disabled",
    "refused": "refused",
}


@dataclass(frozen=True, slots=True)
class Outcome:
    verdict: Verdict
    reason: str
    status: int | None = None
    retry_after_s: float | None = None


def classify(status: int, retry_after: str | None, now: float) -> Outcome:
    """What an HTTP status means for the delivery."""
    if 200 <= status < 300:
        return Outcome("delivered", f"HTTP {status}", status)
    if status == 410:
        return Outcome("gone", "HTTP 410 Gone: endpoint disabled", status)
    if status == 429 or status >= 500:
        return Outcome("retry", f"HTTP {status}", status, parse_retry_after(retry_after, now))
    return Outcome("fail", f"HTTP {status}", status)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), else None."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now)


def backoff_s(
    attempt: int, cfg: WebhooksConfig, retry_after_s: float | None, rng: random.Random
) -> float:
    """Delay after failed attempt ``attempt`` (1-based): base·2^(n-1) with ±25% jitter,
    capped, and never shorter than what the receiver asked for in Retry-After."""
    delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1))
    delay *= rng.uniform(0.75, 1.25)
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    return float(min(delay, cfg.backoff_max_s))


BUSY_BASE_S = 0.5


def busy_wait_s(busy: int, cfg: WebhooksConfig, rng: random.Random) -> float:
    """Wait before looking for a free slot again: 0.5 s doubling per miss up to the attempt
    timeout (by then every slot's holder has finished), with jitter to spread the herd."""
    wait = min(cfg.attempt_timeout_s, BUSY_BASE_S * 2 ** min(busy, 16))
    return float(wait) * rng.uniform(0.5, 1.0)


def encode_body(raw_result: bytes, fmt: Format) -> bytes:
    """The POST body: a Standard Webhooks payload ``{type, timestamp, data: <result>}``; the
    result goes as stored, so fields a newer worker added reach the receiver too."""
    result = decode_result(raw_result)  # checks it is a result
    stamp = datetime.fromtimestamp(result.finished_at_ms / 1000, tz=timezone.utc)
    payload = {
        "type": EVENT_TYPE,
        "timestamp": stamp.isoformat().replace("+00:00", "Z"),
        "data": result_map(raw_result),
    }
    if fmt == "msgpack":
        return pack(payload)
    return json.dumps(payload, separators=(",", ":")).encode()


SCHEDULED = threading.Event()
"""Set when this process schedules a delivery: wakes its scheduler (:mod:`.worker`) early."""

DEFAULT_RESULT_TTL_S = 3600


class Deliverer:
    """Everything an attempt needs, built once per worker process from the fleet file."""

    def __init__(
        self,
        cfg: WebhooksConfig,
        client: SyncClient,
        result_ttls: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.keys = WebhookKeys()
        self.policy = ssrf.Policy.build(cfg.allow, allow_http=cfg.allow_http)
        self.slots = endpoints.Slots(
            client,
            cfg.endpoint_concurrency,
            cfg.slow_endpoint_concurrency,
            cfg.attempt_timeout_s,
            slow_lane=max(1, cfg.concurrency // 2),
        )
        self.result_ttls = dict(result_ttls or {})
        self.clock = clock
        self.rng = random.Random()

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def body(self, d: Delivery) -> bytes:
        if d.redelivery_of is not None:
            record = deadletter.get(self.client, d.redelivery_of)
            if record is None:
                raise DeliveryFailed(f"dead-letter record {d.redelivery_of} is gone")
            if record.body:  # empty when the result had expired: try the result key again
                return record.body
        raw = self.client.get(ModelKeys(d.model).result(d.request_id))
        if raw is None:
            raise DeliveryFailed(f"result of {d.request_id} expired before it was delivered")
        return encode_body(raw if isinstance(raw, bytes) else raw.encode(), d.format)

    def attempt(self, d: Delivery, body: bytes) -> Outcome:
        """One POST. Never raises for the endpoint's behaviour: returns what to do next."""
        if endpoints.is_disabled(self.client, d.url):
            return Outcome(
                "disabled", "endpoint disabled (it answered 410 Gone): `batchfleet webhooks enable`"
            )
        secret = self.cfg.secret_for(d.secret_id)
        if secret is None:
            which = f"secret_id {d.secret_id!r}" if d.secret_id else "the fleet's default secret"
            return Outcome("fail", f"no webhook secret configured for {which}")
        try:
            target = ssrf.check_url(d.url, self.policy)
        except TargetRefused as exc:
            return Outcome("refused", f"refused: {exc}")
        except NetworkError as exc:  # DNS
            return Outcome("retry", str(exc))
        endpoint = endpoints.endpoint_of(d.url)
        token = self.slots.acquire(endpoint, self.now_ms())
        if token is None:
            return Outcome("busy", f"{endpoint} has all its delivery slots in use")
        how: Literal["answered", "timeout", "error"] = "error"
        try:
            reply = ssrf.post(
                target,
                body,
                {
                    **signed_headers(secret, d.webhook_id, body, now=self.clock()),
                    "Content-Type": "application/json"
                    if d.format == "json"
                    else "application/msgpack",
                    "User-Agent": USER_AGENT,
                },
                connect_timeout=self.cfg.connect_timeout_s,
                read_timeout=self.cfg.read_timeout_s,
                attempt_timeout=self.cfg.attempt_timeout_s,
                max_response_bytes=self.cfg.max_response_bytes,
            )
            how = "answered"
        except AttemptTimeout as exc:
            how = "timeout"
            return Outcome("retry", str(exc))
        except NetworkError as exc:
            return Outcome("retry", str(exc))
        finally:
            self.slots.release(endpoint, token, how)
        return classify(reply.status, reply.headers.get("retry-after"), self.clock())

    def schedule(self, d: Delivery, retries: int, delay_s: float) -> int:
        """Park a delivery in Redis until it is due (see :mod:`.worker`); returns the due ms."""
        member = json.dumps({"kwargs": d.model_dump(), "retries": retries}, sort_keys=True)
        due_ms = self.now_ms() + int(delay_s * 1000)
        self.client.zadd(self.keys.scheduled, {member: due_ms})
        SCHEDULED.set()
        return due_ms

    def report(
        self, d: Delivery, state: State, attempts: int, outcome: Outcome, **extra: Any
    ) -> None:
        """Write the delivery's status for the submitter (:mod:`.status`)."""
        found = WebhookStatus(
            state=state,
            webhook_id=d.webhook_id,
            url=d.url,
            attempts=attempts,
            reason=outcome.reason,
            http_status=outcome.status,
            updated_ms=self.now_ms(),
            **extra,
        )
        ttl = self.result_ttls.get(d.model, DEFAULT_RESULT_TTL_S)
        status.write(self.client, d.model, d.request_id, found, ttl)

    def run(self, d: Delivery, retries: int) -> dict[str, Any]:
        """One delivery attempt (attempt number ``retries + 1``) and what follows from it.
        Returns the task's result; raises :class:`DeliveryFailed` when it gives up."""
        attempt = retries + 1
        try:
            body = self.body(d)
        except DeliveryFailed as exc:
            self.give_up(d, b"", Outcome("fail", str(exc)), attempt)
            raise
        outcome = self.attempt(d, body)
        if outcome.verdict == "busy":  # no attempt made: look for a free slot again later
            delay = busy_wait_s(d.busy, self.cfg, self.rng)
            self.schedule(d.model_copy(update={"busy": d.busy + 1}), retries, delay)
            return {"webhook_id": d.webhook_id, "endpoint_busy": True, "retry_in_s": delay}
        log = f"webhook {d.webhook_id} of {d.model}/{d.request_id} #{attempt}: {outcome.reason}"
        if outcome.verdict == "delivered":
            logger.info("%s: delivered", log)
            if d.redelivery_of is not None:
                deadletter.remove(self.client, d.redelivery_of)
            self.report(d, "delivered", attempt, outcome)
            return {"webhook_id": d.webhook_id, "status": outcome.status, "attempts": attempt}
        if outcome.verdict == "retry" and attempt < self.cfg.max_attempts:
            delay = backoff_s(attempt, self.cfg, outcome.retry_after_s, self.rng)
            logger.info("%s: retrying in %.1fs", log, delay)
            due_ms = self.schedule(d.model_copy(update={"busy": 0}), attempt, delay)
            self.report(d, "scheduled", attempt, outcome, next_attempt_ms=due_ms)
            return {"webhook_id": d.webhook_id, "retry_in_s": round(delay, 3)}
        if outcome.verdict == "gone":
            endpoints.disable(self.client, d.url, self.now_ms(), d.webhook_id, outcome.reason)
        logger.warning("%s: giving up", log)
        self.give_up(d, body, outcome, attempt)
        raise DeliveryFailed(f"{log}: giving up")

    def give_up(self, d: Delivery, body: bytes, outcome: Outcome, attempts: int) -> None:
        """Dead-letter the delivery and report its final state."""
        record_id = deadletter.record(
            self.client, self.cfg, d, body, outcome.reason, outcome.status, attempts
        )
        state = FINAL_STATE.get(outcome.verdict, "failed")
        self.report(d, state, attempts, outcome, dead_letter_id=record_id)


_deliverers: dict[int, Deliverer] = {}
_lock = threading.Lock()


def deliverer_for(app: Celery) -> Deliverer:
    with _lock:
        found = _deliverers.get(id(app))
        if found is None:
            fleet = app.batchfleet_config
            ttls = {name: m.result_ttl_s for name, m in fleet.models.items()}
            found = Deliverer(fleet.webhooks, connect(fleet.redis_url), ttls)
            _deliverers[id(app)] = found
        return found


def deliver(task: Task, **kwargs: Any) -> dict[str, Any]:
    """One delivery attempt (the body of the Celery task ``batchfleet.webhooks.deliver``)."""
    d = Delivery.model_validate(kwargs)
    if d.first_attempt_ms is None:
        d = d.model_copy(update={"first_attempt_ms": int(time.time() * 1000)})
    return deliverer_for(task.app).run(d, task.request.retries or 0)


def register(app: Celery) -> Task:
    """Define the delivery task on ``app`` (the batch workers send it, webhook workers run it)."""
    return app.task(
        name=TASK_NAME,
        bind=True,
        shared=False,
        queue=WEBHOOK_QUEUE,
        acks_late=True,
        reject_on_worker_lost=True,
        max_retries=None,
        ignore_result=True,
        throws=(DeliveryFailed,),  # FAILURE in Flower, logged without a traceback
    )(deliver)
