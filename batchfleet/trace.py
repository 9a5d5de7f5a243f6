"""A request's journey, from what Redis still holds: ``batchfleet trace MODEL ID``.

Sources, each of which may be gone: the request's entry in its lane stream (while it
waits or is being computed) with its pending-list record (consumer, deliveries); the
stored result (until its TTL: status, timings, batch id, worker); the dead-letter stream;
the webhook retry schedule and failed-delivery records. Lanes and dead letters are not
indexed by request id, so they are scanned (at most ``max_scan`` entries each).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import redis

from .connection import SyncClient
from .dlq import DeadLetter, list_dead
from .fleetview import DEFAULT_LANES, entry_ms
from .schemas.codec import decode_result, envelope_of
from .schemas.keys import GROUP, ModelKeys, WebhookKeys

MAX_SCAN = 100_000
CHUNK = 1000


@dataclass
class Trace:
    """Everything known about one request; None where nothing is left to tell."""

    model: str
    request_id: str
    state: str = "unknown"
    """``waiting`` (queued, not read), ``in progress`` (read by a worker, not answered),
    ``answered`` (a result is stored), ``dead letter``, or ``unknown`` (nothing found)."""
    lane: int | None = None
    entry_id: str | None = None
    entered_at_ms: int | None = None
    """When the request was added (its entry id's time, or the result's finish minus total)."""
    consumer: str | None = None
    """The worker holding (or that last held) its entry."""
    deliveries: int | None = None
    """Times its entry was delivered to a worker (above 1: redelivered after a crash)."""
    idle_ms: int | None = None
    status: str | None = None
    """The result's status: ok, error, expired."""
    error: dict[str, str] | None = None
    timings: dict[str, Any] | None = None
    """The result's timings: queued, batch wait, inference, total (ms), batch size and id,
    worker."""
    finished_at_ms: int | None = None
    result_ttl_ms: int | None = None
    dead_letter: dict[str, Any] | None = None
    webhook: dict[str, Any] | None = None
    """Latest webhook delivery state: a scheduled retry or a failed record; None when none
    is recorded (delivered, in flight, or no webhook)."""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def trace(client: SyncClient, model: str, request_id: str, *, max_scan: int = MAX_SCAN) -> Trace:
    """What Redis still knows about ``request_id`` of ``model``."""
    keys = ModelKeys(model)
    out = Trace(model, request_id)
    _result(client, keys, out)
    if out.status is None:  # answered entries are deleted with the result write
        _lanes(client, keys, out, max_scan)
    _dead_letter(client, model, out, max_scan)
    _webhook(client, model, out)
    if out.state == "unknown":
        out.notes.append(
            "nothing found: never submitted, its result expired, or it lies beyond the "
            f"first {max_scan} entries of a lane"
        )
    return out


def _result(client: SyncClient, keys: ModelKeys, out: Trace) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.result(out.request_id))
    pipe.pttl(keys.result(out.request_id))
    raw, ttl = pipe.execute()
    if raw is None:
        return
    result = decode_result(raw)
    timings = result.timings.model_dump()
    out.state = "answered"
    out.status = result.status
    out.error = result.error.model_dump(mode="json") if result.error else None
    out.timings = timings
    out.consumer = timings["worker"] or None
    out.finished_at_ms = result.finished_at_ms
    out.entered_at_ms = int(result.finished_at_ms - timings["total_ms"])
    out.result_ttl_ms = int(ttl) if ttl and ttl > 0 else None


def _lanes(client: SyncClient, keys: ModelKeys, out: Trace, max_scan: int) -> None:
    lanes = int(client.get(keys.lanes_key) or DEFAULT_LANES)
    for lane in range(lanes):
        entry_id = _find_in_stream(client, keys.lane(lane), out.request_id, max_scan)
        if entry_id is None:
            continue
        out.lane, out.entry_id, out.entered_at_ms = lane, entry_id, entry_ms(entry_id)
        out.state = "waiting"
        try:
            pending = client.xpending_range(keys.lane(lane), GROUP, entry_id, entry_id, 1)
        except redis.ResponseError:  # no consumer group yet: no worker has read it
            pending = []
        if pending:
            record = pending[0]
            out.state = "in progress"
            out.consumer = _s(record["consumer"])
            out.deliveries = int(record["times_delivered"])
            out.idle_ms = int(record["time_since_delivered"])
        return


def _find_in_stream(client: SyncClient, stream: str, request_id: str, limit: int) -> str | None:
    start, seen = "-", 0
    while seen < limit:
        chunk: Any = client.xrange(stream, start, "+", count=min(CHUNK, limit - seen))
        for entry_id, fields in chunk:
            if envelope_of(fields).id == request_id:
                return _s(entry_id)
        if len(chunk) < CHUNK:
            return None
        seen += len(chunk)
        start = "(" + _s(chunk[-1][0])
    return None


def _dead_letter(client: SyncClient, model: str, out: Trace, max_scan: int) -> None:
    found: DeadLetter | None = None
    for dead in list_dead(client, model, max_scan):
        if dead.request_id == out.request_id:
            found = dead  # the latest one wins
    if found is None:
        return
    out.dead_letter = found.to_json()
    lane = ModelKeys(model).lane_of(found.source)
    if out.state == "unknown":
        out.state = "dead letter"
        out.lane = lane
        out.consumer = found.worker or None
        if found.source_id:
            out.entered_at_ms = entry_ms(found.source_id)


def _webhook(client: SyncClient, model: str, out: Trace) -> None:
    keys = WebhookKeys()
    scheduled: Any = client.zrange(keys.scheduled, 0, -1, withscores=True)
    for member, due_ms in scheduled:
        item = json.loads(member)
        kwargs = item.get("kwargs", {})
        if (kwargs.get("model"), kwargs.get("request_id")) == (model, out.request_id):
            out.webhook = {
                "state": "retry scheduled",
                "url": kwargs.get("url"),
                "retries": item.get("retries"),
                "due_ms": int(due_ms),
            }
    failed: Any = client.xrange(keys.failed)
    for entry_id, fields in failed:
        delivery = json.loads(fields.get(b"delivery", b"{}"))
        if (delivery.get("model"), delivery.get("request_id")) == (model, out.request_id):
            status = fields.get(b"status", b"")
            out.webhook = {
                "state": "failed",
                "url": delivery.get("url"),
                "record": _s(entry_id),
                "reason": _s(fields.get(b"reason", b"")),
                "http_status": int(status) if status else None,
                "attempts": int(fields.get(b"attempts", b"0")),
            }
    if out.webhook and client.hexists(keys.disabled, out.webhook["url"] or ""):
        out.webhook["endpoint_disabled"] = True


def render(t: Trace) -> str:
    """``batchfleet trace``'s text: one ``name: value`` line per known fact."""
    lines = [f"{t.model} {t.request_id}: {t.state}"]

    def add(name: str, value: Any) -> None:
        if value is not None:
            lines.append(f"  {name}: {value}")

    add("lane", t.lane)
    add("entry", t.entry_id)
    add("entered at", _when(t.entered_at_ms))
    add("worker", t.consumer)
    add("deliveries", t.deliveries)
    add("idle (ms)", t.idle_ms)
    add("result", t.status)
    if t.error:
        add("error", f"{t.error['code']}: {t.error['message']}")
    if t.timings:
        tm = t.timings
        add("batch", f"{tm['batch_id']} ({tm['batch_size']} rows)")
        add(
            "timings (ms)",
            f"queued {tm['queued_ms']:.1f}, batch wait {tm['batch_wait_ms']:.1f}, "
            f"inference {tm['inference_ms']:.1f}, total {tm['total_ms']:.1f}",
        )
    add("finished at", _when(t.finished_at_ms))
    add("result expires in (ms)", t.result_ttl_ms)
    if t.dead_letter:
        d = t.dead_letter
        add("dead letter", f"{d['id']} {d['code']}: {d['reason']} (worker {d['worker']})")
    if t.webhook:
        add("webhook", ", ".join(f"{k} {v}" for k, v in t.webhook.items() if v is not None))
    lines += [f"  note: {n}" for n in t.notes]
    return "\n".join(lines)


def _when(ms: int | None) -> str | None:
    if ms is None:
        return None
    stamp = datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")
    return f"{stamp.replace('+00:00', 'Z')} (unix ms {ms})"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
