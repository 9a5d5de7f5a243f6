"""What the intake learns about entries it read before handing them to the loop: the inputs
they reference (read here, so the loop's CPU side finds the bytes in hand), which
redelivered ones were answered already (the sink republishes and acks those), and, for a
generating model, which were cancelled before they were read (ended before any step).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import redis

from ..redis_errors import UNREACHABLE
from ..schemas.codec import envelope_of
from ..schemas.messages import Limits
from .blobs import fetch_referenced, referenced_keys
from .streams import Entry, ModelStreams, Retiring

logger = logging.getLogger(__name__)

BLOB_READ_TRIES = 3
"""Tries of a read of the inputs entries reference (50 ms, then 200 ms apart); if all fail,
those entries are handed back to the fleet, never answered as if the input were missing."""


def with_blobs(
    entries: list[Entry],
    streams: ModelStreams,
    limits: Limits,
    release_idle_ms: int,
    pause: Callable[[float], None],
) -> list[Entry]:
    """``entries`` carrying the inputs they reference. If reading those keeps failing
    (Redis unreachable or timing out), the referencing entries are handed back, marked idle
    ``release_idle_ms``: the next reclaim reads them again, and no delivery is counted."""
    for attempt in range(BLOB_READ_TRIES):
        try:
            return fetch_referenced(entries, streams, limits)
        except UNREACHABLE as exc:
            error = exc
            if attempt + 1 < BLOB_READ_TRIES:
                pause(0.05 * 4**attempt)
    unread = [e for e in entries if referenced_keys(e, streams.keys, limits)]
    logger.warning(
        "reading the inputs %d requests reference failed %d times (%s): handed back",
        len(unread), BLOB_READ_TRIES, error,
    )  # fmt: skip
    with contextlib.suppress(redis.RedisError):  # else they wait out claim_idle_ms
        streams.release(unread, release_idle_ms)
    gone = {e.key for e in unread}
    return [e for e in entries if e.key not in gone]


def answered(entries: list[Entry], streams: ModelStreams, limits: Limits) -> list[Retiring]:
    """The redelivered entries whose request has a result already; the others wait again
    here, so their ``started`` keys (a previous holder's) go until admitted."""
    again = [(e, envelope_of(e.fields, limits)) for e in entries if e.deliveries > 1]
    known = [Retiring(e, env.id, env.reply) for e, env in again if env.id is not None]
    if not known:
        return []
    have = streams.have_results([k.request_id for k in known])
    streams.requeued([k.request_id for k, h in zip(known, have, strict=True) if not h])
    return [k for k, h in zip(known, have, strict=True) if h]


def cancelled_before(entries: list[Entry], streams: ModelStreams, limits: Limits) -> list[str]:
    """The requests of ``entries`` a client cancelled before they were read."""
    ids = [i for e in entries if (i := envelope_of(e.fields, limits).id) is not None]
    return streams.cancelled(ids)
