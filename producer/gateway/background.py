"""Background responses (``background: true``, OpenAI's and vLLM's): answered at once,
``queued`` (or streamed: ``background_events.py``), then polled (``GET /v1/responses/{id}``)
until final, or cancelled (``POST /v1/responses/{id}/cancel``).

No gateway runs them: the fleet request is submitted (streamed, so that its token stream
holds its deltas) and the response stored ``queued`` with what
finishing it takes (its fleet request's model, the name it is answered under and the
request body). Any gateway that reads it settles it (:func:`settle`): where the fleet's
result is there, it builds the final response as an answer waited for is built, and stores
it in place of the pending one; where not, it is ``in_progress`` once a live worker
admitted it (its ``started`` key: the worker reads its prompt, before any token; from
workers older than that key, once its token stream has an entry), else still ``queued``
(waiting in a lane, in a worker's hold for a free slot, or again after its worker died). A gateway that stops or
restarts loses nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import redis

from ...schemas.keys import ModelKeys
from ...schemas.messages import Result
from ..aio import AsyncJob
from . import continued
from .endpoint import Answered
from .errors import of_result
from .fleet_control import live_workers
from .replies import DOWN
from .responses import echoed, response, settings
from .state import Gateway
from .stored import Stored

logger = logging.getLogger(__name__)

PENDING = ("queued", "in_progress")
"""A background response's statuses before it is final."""
ERROR_CODE = {400: "invalid_prompt", 429: "rate_limit_exceeded"}
"""OpenAI's ``error.code`` of a failed response, by the fleet error's HTTP status (else
``server_error``)."""


def pending(model: str, alias: str | None, body: Mapping[str, Any]) -> dict[str, Any]:
    """What finishing a background response takes: its fleet request's model, the name it
    is answered under (a LoRA adapter's, or None) and the body (its input is stored apart)."""
    return {"model": model, "alias": alias, "body": {k: v for k, v in body.items() if k != "input"}}


def queued(body: Mapping[str, Any], answered: Answered, model: str) -> dict[str, Any]:
    """The response a ``background`` request answers at once."""
    return settings(body, answered, model) | {"status": "queued"}


def failed(body: Mapping[str, Any], answered: Answered, result: Result) -> dict[str, Any]:
    """A response whose fleet request failed: ``failed``, with OpenAI's ``error`` (the
    fleet's code in the message)."""
    error = of_result(result)
    code = ERROR_CODE.get(error.status, "server_error")
    return settings(body, answered, result.model) | {
        "status": "failed",
        "error": {"code": code, "message": f"{error.code}: {error.message}"},
    }


def final(found: Stored, result: Result) -> dict[str, Any]:
    """The final response of a pending one, from its fleet request's result: as a whole
    answer is built; one cancelled stays cancelled (with the text the result holds)."""
    assert found.pending is not None
    body, alias = found.pending["body"], found.pending["alias"]
    if alias is not None:
        result = result.model_copy(update={"model": alias})
    was = found.response
    answered = echoed(was)
    if was["status"] == "cancelled":
        if not result.ok:
            return was
        return response(body, result, answered) | {"status": "cancelled", "completed_at": None,
                                                    "incomplete_details": None}  # fmt: skip
    return response(body, result, answered) if result.ok else failed(body, answered, result)


def job(gateway: Gateway, found: Stored) -> AsyncJob:
    """A background response's fleet request (its ``pending``'s, or once final its
    ``replay``'s)."""
    info = found.pending or found.replay
    assert info is not None
    rid = found.response["id"].removeprefix("resp_")
    return AsyncJob(rid, info["model"], producer=gateway.producer,
                    streaming=found.replay is not None)  # fmt: skip


async def started(gateway: Gateway, fleet: AsyncJob) -> bool:
    """Whether a worker admitted ``fleet`` (its prompt is being read, or generated from)
    and is alive: its ``started`` key (docs/protocol.md; workers older than it do not write
    it) names a worker whose heartbeat is recent. One that died with it waits again (the
    worker that takes it over deletes the key; until then, or where none is left to, the
    dead one's name stands in it)."""
    client = gateway.producer.client
    holder = await client.get(ModelKeys(fleet.model).started(fleet.id))
    if holder is None:
        return False
    name = holder.decode() if isinstance(holder, bytes) else str(holder)
    return name in await live_workers(client, [fleet.model])


async def begun(gateway: Gateway, found: Stored) -> bool:
    """Whether a pending response's fleet request has begun: a worker admitted it
    (:func:`started`), or, from a worker older than that signal, its token stream has an
    entry (the first token). One submitted unstreamed (by a gateway older than ``replay``)
    has no token stream."""
    fleet = job(gateway, found)
    if await started(gateway, fleet):
        return True
    if not fleet.streaming:
        return False
    stream = ModelKeys(fleet.model).tokens(fleet.id)
    return bool(await gateway.producer.client.xread({stream: "0-0"}, count=1))


async def settle(gateway: Gateway, found: Stored) -> Stored:
    """``found`` as it stands now: a pending one whose fleet result is there is made final
    and stored so (its TTL kept: it expires when it would have); one ``queued`` whose fleet
    request has begun is answered ``in_progress`` (not stored: a cancel may be under way);
    else as it was."""
    if found.pending is None:
        return found
    result = await job(gateway, found).peek()
    if result is None:
        if found.response["status"] == "queued" and await begun(gateway, found):
            return replace(found, response=found.response | {"status": "in_progress"})
        return found
    return await settled(gateway, found, result)


async def settled(gateway: Gateway, found: Stored, result: Result) -> Stored:
    """Pending ``found`` made final from its fleet ``result``, and stored so (its TTL kept)."""
    done = Stored(final(found, result), found.input, replay=found.replay)
    await continued.settled(gateway, found, done.response)  # made with conversation
    try:
        stored = await gateway.responses.put(done.response, done.input, replay=done.replay,
                                             again=True)  # fmt: skip
    except (*DOWN, redis.ResponseError) as exc:
        stored = False
        logger.warning("response %s answered, not stored settled: %s", done.response["id"], exc)
    if stored:
        logger.info("background response %s settled: %s", done.response["id"],
                    done.response["status"])  # fmt: skip
    return done
