"""A background response's server-sent events (``background`` with ``stream`` on ``POST
/v1/responses``; ``GET /v1/responses/{id}?stream=true&starting_after=N`` resumes them),
rebuilt by any gateway from what Redis holds: the stored response (its settings, id and
creation time), its fleet request's token stream (every delta from the first, kept as
long as the result) and its result.

The same entries give the same events under the same ``sequence_number`` each time they
are rebuilt, so a client that lost its connection resumes after the last event it read, on
any gateway, with no gap and no repeat. Its connection closing ends only that stream: the
response goes on (``POST /v1/responses/{id}/cancel`` stops it).

The events: ``response.created`` and ``response.queued`` (status ``queued``) at once,
``response.in_progress`` once a worker admitted the fleet request (its ``started`` key,
looked for every ``STARTED_POLL_S`` until the first delta: a long prompt is read before
any token comes; from workers older than that key, with the first delta), then a foreground stream's
(:class:`~.responses.ResponseEvents`) up to the last, which carries the final response as
stored: ``response.completed``, ``response.failed``, or ``response.incomplete`` (status
``incomplete`` or ``cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

import redis
import tornado.iostream

from ...cancels import stop
from ...schemas.errors import BatchfleetError
from ...schemas.messages import Delta, Result
from ..tokens import DeltaFollower, Restarted
from .background import job, settled, started
from .errors import ApiError, of_exception
from .handler import Handler, dumps
from .replay import Diverged
from .replies import DOWN
from .responses import ResponseEvents, echoed, settings
from .state import Gateway
from .stored import Stored

logger = logging.getLogger(__name__)

STARTED_POLL_S = 0.5
"""How often a stream with no delta yet looks whether a worker admitted its request."""
TERMINAL = {"completed": "response.completed", "failed": "response.failed"}
"""The last event's type, by the final response's status (else ``response.incomplete``)."""


class BackgroundEvents(ResponseEvents):
    """:class:`ResponseEvents` that open ``queued`` (:meth:`opening`), go ``in_progress``
    with the first delta, and end with the final response as stored (:meth:`close`)."""

    def opening(self) -> list[dict[str, Any]]:
        """The first events, before the fleet request begins."""
        queued = settings(self.body, self.answered, self.model) | {"status": "queued"}
        return self._numbered([{"type": "response.created", "response": queued},
                               {"type": "response.queued", "response": queued}])  # fmt: skip

    def _begin(self) -> list[dict[str, Any]]:
        self.begun = True
        begun = settings(self.body, self.answered, self.model)
        return [{"type": "response.in_progress", "response": begun}]

    def started(self) -> list[dict[str, Any]]:
        """``response.in_progress``, where not sent yet: a worker admitted the request."""
        return [] if self.begun else self._numbered(self._begin())

    def feed(self, event: Delta | Restarted) -> list[dict[str, Any]]:
        """As :meth:`ResponseEvents.feed`; the first delta begins the response, text or not
        (as ``GET`` answers it ``in_progress`` from then on)."""
        out = super().feed(event)
        if not out and not self.begun and isinstance(event, Delta):
            out = self._number(self._begin())
        return out

    def close(self, result: Result, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The last events: each item closed (:meth:`finish`), then ``final``, the response
        as stored once final; a failed one ends at once."""
        if not result.ok:
            return self._numbered([{"type": TERMINAL.get(final["status"], "response.failed"),
                                    "response": final}])  # fmt: skip
        out = self.finish(result)
        out[-1] |= {"type": TERMINAL.get(final["status"], "response.incomplete"), "response": final}
        return out

    def error(self, error: ApiError) -> list[dict[str, Any]]:
        """OpenAI's ``error`` event, that ends a stream short of its end (not rebuilt: a
        client resumes after the last other event it read)."""
        return [{"type": "error", "code": error.code, "message": error.message,
                 "param": error.param, "sequence_number": self.seq}]  # fmt: skip


async def rebuilt(gateway: Gateway, found: Stored) -> AsyncGenerator[list[dict[str, Any]], None]:
    """Every event of background response ``found`` (stored with its ``replay``), from the
    first: those Redis holds at once, then each as the worker writes it, the last with the
    final response (made final and stored here where no gateway did yet)."""
    info, was = found.replay, found.response
    assert info is not None
    fleet = job(gateway, found)
    events = BackgroundEvents(info["body"], echoed(was),
                              info["alias"] or fleet.model)  # fmt: skip
    yield events.opening()
    deltas = gateway.producer.follow(fleet, DeltaFollower(), gateway.timeout_s)
    first = asyncio.ensure_future(anext(deltas))
    try:
        while not first.done() and not events.begun:  # in_progress before the first token
            if await started(gateway, fleet):
                yield events.started()
            else:
                await asyncio.wait((first,), timeout=STARTED_POLL_S)
        with contextlib.suppress(StopAsyncIteration):  # no delta at all
            yield events.feed(await first)
            async for delta in deltas:
                yield events.feed(delta)
        result = await gateway.replies.wait(fleet, gateway.timeout_s)
        now = await gateway.responses.get(was["id"])
    except Diverged as exc:
        yield events.error(ApiError(500, str(exc), code="stream_restarted"))
        return
    except BatchfleetError as exc:
        yield events.error(of_exception(exc))
        return
    except (*DOWN, redis.ResponseError) as exc:
        yield events.error(ApiError(503, f"Redis unreachable: {exc}", code="unavailable"))
        return
    finally:
        first.cancel()  # the client left before the first delta (else: done, a no-op)
    if now is None:  # deleted meanwhile
        yield events.error(ApiError(404, f"Response with id '{was['id']}' not found.",
                                    code="not_found"))  # fmt: skip
        return
    if now.pending is not None:
        now = await settled(gateway, now, result)
    yield events.close(result, now.response)


async def send(handler: Handler, found: Stored, after: int = -1) -> None:
    """Stream the events of background response ``found`` numbered past ``after`` to
    ``handler``'s client, until the last; the client leaving ends this stream only."""
    handler.set_header("Content-Type", "text/event-stream")
    handler.set_header("Cache-Control", "no-cache")
    was, started = found.response, False
    left = asyncio.ensure_future(handler.left.wait())
    batches = rebuilt(handler.gateway, found)
    try:
        await handler.flush()  # the head at once: a resumed stream may wait long for an event
        async with contextlib.aclosing(batches):
            while True:
                batch = asyncio.ensure_future(anext(batches))
                await asyncio.wait((batch, left), return_when=asyncio.FIRST_COMPLETED)
                if not batch.done():  # the client left while the fleet was quiet
                    await stop(batch)
                    return
                try:
                    events = [e for e in batch.result() if e["sequence_number"] > after]
                except StopAsyncIteration:
                    break
                if not events:
                    continue
                if handler.gone:
                    return
                if not started:
                    started = True
                    handler.gateway.metrics.first_event.labels(handler.route).observe(
                        handler.request.request_time())  # fmt: skip
                handler.write("".join(f"event: {e['type']}\ndata: {dumps(e)}\n\n"
                                      for e in events))  # fmt: skip
                await handler.flush()
        handler.finish()
    except tornado.iostream.StreamClosedError:
        pass
    finally:
        left.cancel()
        if handler.gone:
            logger.info("background response %s: its client left (it goes on)", was["id"])
